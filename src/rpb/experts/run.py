"""``rpb experts``: the task's experts per MoE layer, chosen from its routing, written as an ESFT expert config.

``gate`` needs the prior alone. ``token`` runs the base once over the prior's own data file (its sha256 and the
base's routers are checked against the prior's metadata first) and counts each sample's top-k selections.

Whatever the measure, a chosen expert the router never selects on the task's tokens (token-selection share 0)
is named in a warning and in the file (``rpb.never_selected``): training it changes nothing the model computes
on this data. The gate measure can rank such an expert high (it reads the router's probabilities, which ignore
an expert-correction bias that selection adds); the check takes the base and the data, so with ``gate`` it runs
when ``--model`` and ``--data-jsonl`` are given, and a line says it did not otherwise.
"""

from __future__ import annotations

import logging
from pathlib import Path

import torch
from tqdm.auto import tqdm

from rpb.adapters import find_moe_layers, routers_sha256
from rpb.data import collate, file_sha256, load_labelled
from rpb.errors import ArgumentError
from rpb.experts.choice import SPANS, ExpertChoice, choose, gate_scores, never_selected, selection_ratio
from rpb.fileio import write_text_atomic
from rpb.models import load_base_model, load_tokenizer, pad_id_of
from rpb.observe.trace import RouterTap, route_batch
from rpb.prior.artifact import prior_kind_of
from rpb.prior.checks import load_prior

logger = logging.getLogger(__name__)

MEASURES = ("gate", "token")


def run_experts(
    prior: str,
    out: str,
    *,
    measure: str = "gate",
    threshold: float | None = None,
    top_n: int | None = None,
    span: str = "all",
    model: str | None = None,
    data_jsonl: str | None = None,
    tokenizer: str | None = None,
    shared_experts: bool = False,
    non_expert_modules: bool = False,
    batch_size: int = 8,
    adapter: str | None = None,
    dtype: str = "float32",
    device: str = "auto",
    progress: bool = True,
) -> ExpertChoice:
    if measure not in MEASURES or span not in SPANS:
        raise ArgumentError(f"measure: one of {MEASURES}, span: one of {tuple(SPANS)}; got {measure!r}, {span!r}")
    if threshold is None and top_n is None:
        threshold = 0.2  # ESFT's usual top-p
    artifact = load_prior(prior)
    meta = artifact.metadata
    if measure == "token" and not (model and data_jsonl):
        raise ArgumentError("measure token: --model (the prior's base) and --data-jsonl (its data) are needed")
    # the token-selection share, which the zero-share check reads whatever the measure
    shares_LE = None
    if model and data_jsonl:
        shares_LE = token_scores(meta, model, data_jsonl, tokenizer, span, batch_size, adapter, dtype, device, progress)
    if measure == "gate" and prior_kind_of(meta) == "frequency":
        logger.warning(
            "rpb experts: %s is a frequency prior (an engine's selections, no router probabilities): the gate "
            "measure reads each expert's selection share, not its mean gate score",
            prior,
        )
    scores_LE = shares_LE if measure == "token" else gate_scores(artifact.prior_qa, artifact.span_tokens, span)
    chosen = choose(scores_LE, threshold, top_n)
    unselected = None if shares_LE is None else never_selected(chosen, shares_LE, meta["moe_layers"])
    _warn_never_selected(unselected, span)
    provenance = {
        "measure": measure,
        "span": span,
        "threshold": threshold,
        "top_n": top_n,
        "prior": str(prior),
        "prior_sha256": file_sha256(prior),
        "prior_kind": prior_kind_of(meta),
        "data_sha256": meta["data_sha256"],
        "model": meta["model"],
        "num_experts": meta["num_experts"],
        "never_selected": None if unselected is None else {str(k): v for k, v in unselected.items()},
        "scores": {
            str(i): [round(float(x), 6) for x in row] for i, row in zip(meta["moe_layers"], scores_LE, strict=True)
        },
    }
    choice = ExpertChoice(
        dict(zip(meta["moe_layers"], chosen, strict=True)), shared_experts, non_expert_modules, provenance
    )
    Path(out).parent.mkdir(parents=True, exist_ok=True)
    write_text_atomic(out, choice.to_json() + "\n")
    return choice


def _warn_never_selected(unselected: dict[int, list[int]] | None, span: str) -> None:
    if unselected is None:
        logger.warning(
            "rpb experts: whether the router ever selects the chosen experts was not checked: it takes "
            "the base and the data (--model, --data-jsonl)"
        )
    elif unselected:
        where = "; ".join(f"layer {layer}: {ids}" for layer, ids in unselected.items())
        logger.warning(
            "rpb experts: %d chosen experts are never selected by the router on the task's tokens "
            "(span %s; token-selection share 0), so training them changes nothing on this data: %s",
            sum(map(len, unselected.values())),
            span,
            where,
        )


def token_scores(meta, model_id, data_jsonl, tokenizer, span, batch_size, adapter, dtype, device, progress):
    """ESFT's token-selection ratio ``[L, E]`` of the base over the prior's data."""
    if file_sha256(data_jsonl) != meta["data_sha256"]:
        raise ArgumentError(f"{data_jsonl}: not the file the prior was collected on (its sha256 differs)")
    tok = load_tokenizer(tokenizer or model_id)
    data = load_labelled(data_jsonl, tok, meta["max_seq_len"], meta["chat_template_kwargs"], meta["chat_template_date"])
    model, facts = load_base_model(model_id, dtype, adapter, device)
    layers = find_moe_layers(model, facts)
    if routers_sha256(layers, facts) != meta["routers_sha256"]:
        raise ArgumentError(f"{model_id}: its routers are not those of the prior's base ({meta['model']})")
    counts_NLE, tokens_N = selection_counts(
        model, layers, data.examples, span, meta["top_k"], meta["num_experts"], batch_size, pad_id_of(tok), progress
    )
    return selection_ratio(counts_NLE, tokens_N, meta["top_k"])


@torch.no_grad()
def selection_counts(model, layers, examples, span, top_k, num_experts, batch_size, pad_id, progress=False):
    """``(counts [N, L, E], tokens [N])``: per sample, how often each expert was among the top-k of its tokens
    of ``span`` (the model's own routing, eval mode)."""
    spans = torch.tensor(SPANS[span])
    N, L = len(examples), len(layers)
    counts_NLE, tokens_N = torch.zeros(N, L, num_experts, dtype=torch.float64), torch.zeros(N, dtype=torch.float64)
    model.eval()
    with RouterTap(layers) as tap:
        for start in tqdm(range(0, N, batch_size), desc="experts", disable=not progress, unit="batch"):
            batch = collate(examples[start : start + batch_size], pad_id)
            route_batch(model, batch)
            B, S = batch["input_ids"].shape
            keep_BS = batch["attention_mask"].bool() & torch.isin(batch["span_ids"], spans)
            tokens_N[start : start + B] = keep_BS.sum(-1).double()
            for pos in range(L):
                ids_BSK = tap.topk_ids[pos].reshape(B, S, top_k).cpu()
                hits_BSE = torch.zeros(B, S, num_experts, dtype=torch.float64).scatter_(-1, ids_BSK, 1.0)
                counts_NLE[start : start + B, pos] = (hits_BSE * keep_BS[..., None]).sum(1)
    return counts_NLE, tokens_N
