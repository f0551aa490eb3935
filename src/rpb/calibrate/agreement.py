"""After training: whose expert choice did the post-trained router learn, the base's or the span prior's?

On a seeded sample of the *training* rows (the only rows with a prior), both models run bias-free in
eval mode on the same tokens. Per MoE layer, over content (Q / A) tokens, it reports the mean overlap
of the post-trained model's selected set with (a) the base model's own token-level set and (b) the
top-k of the span prior the bias was made of, each |a ∩ b| / k. A run whose routing moved toward the
span mean shows (b) rising and (a) falling against the same figures for ``sft``.
"""

from __future__ import annotations

import random
from pathlib import Path

import torch

from rpb.adapters import find_moe_layers
from rpb.anchors.verify import PriorMismatchError
from rpb.calibrate.measure import set_overlap
from rpb.collect.collector import plan_batches
from rpb.collect.rows import index_rows, label_rows
from rpb.data import ChatTemplate, collate
from rpb.models import load_base_model, load_tokenizer, pad_id_of
from rpb.observe.trace import RouterTap, route_batch
from rpb.prior.checks import load_prior

DEFAULT_ROWS = 256


def training_rows_agreement(
    base: str | Path,
    post: str | Path,
    prior: str | Path,
    data_jsonl: str | Path,
    rows: int = DEFAULT_ROWS,
    seed: int = 0,
    batch_size: int = 64,
    device: str = "cpu",
) -> dict:
    """``{"overlap_base": [per layer], "overlap_prior": [per layer], "mean_overlap_base", "mean_overlap_prior",
    "rows", "seed"}`` for the post-trained model on a seeded sample of the prior's rows."""
    artifact = load_prior(prior)
    max_seq_len = artifact.metadata["max_seq_len"]
    tok = load_tokenizer(str(base))
    meta = artifact.metadata
    template = ChatTemplate(tok, meta.get("chat_template_kwargs"), meta.get("chat_template_date"))  # as collected
    index = index_rows(data_jsonl)  # the prior's own rows, checked when it was collected: no second scan
    if index.sha256 != meta["data_sha256"]:
        raise PriorMismatchError(str(prior), [("data_sha256", meta["data_sha256"], index.sha256)])
    chosen = sorted(random.Random(seed).sample(range(index.num_rows), min(rows, index.num_rows)))
    examples = label_rows(index, template, max_seq_len, chosen)
    row_of = {i: r for r, i in enumerate(chosen)}
    pi_RSLE = artifact.prior_qa[chosen]
    models = [load_base_model(str(path), device=device) for path in (base, post)]
    layers = [find_moe_layers(m, facts) for m, facts in models]
    top_k = int(getattr(models[0][0].config, models[0][1].top_k_config))
    sums = {"overlap_base": [0] * len(layers[0]), "overlap_prior": [0] * len(layers[0])}
    content = 0
    for positions in plan_batches([len(e) for e in examples], batch_size):
        batch = collate([examples[i] for i in positions], pad_id_of(tok))
        taps = [RouterTap(lay) for lay in layers]
        for (model, _), tap in zip(models, taps, strict=True):
            with tap:
                route_batch(model, batch)
        span_T = batch["span_ids"].reshape(-1)
        keep = (span_T >= 0) & batch["attention_mask"].reshape(-1).bool()
        rows_B = torch.tensor([row_of[int(i)] for i in batch["sample_index"]])
        rows_T = rows_B[:, None].expand_as(batch["span_ids"])
        rows_T, spans = rows_T.reshape(-1)[keep], span_T[keep]
        content += int(keep.sum())
        for pos in range(len(layers[0])):
            post_TK = taps[1].topk_ids[pos][keep]
            experts = taps[1].logits[pos].shape[-1]
            prior_TK = pi_RSLE[rows_T, spans, pos].topk(top_k, dim=-1).indices
            sums["overlap_base"][pos] += int(set_overlap(post_TK, taps[0].topk_ids[pos][keep], experts).sum())
            sums["overlap_prior"][pos] += int(set_overlap(post_TK, prior_TK, experts).sum())
    out: dict = {name: [v / (top_k * content) for v in per_layer] for name, per_layer in sums.items()}
    out |= {f"mean_{name}": sum(v) / len(v) for name, v in list(out.items())}
    return out | {"rows": len(chosen), "seed": seed, "content_tokens": content}
