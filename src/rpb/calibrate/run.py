"""``rpb calibrate``: the prior bias on the frozen base model, before any training.

Nothing trains. The base runs in eval mode (no dropout, no router jitter) on a seeded sample of
the data file's rows, and for each candidate beta this measures how far ``beta * b`` moves the
base's own expert choice on content (Q / A) tokens:

* ``displacement_counterfactual[beta][layer]``: the bias applied to one layer at a time, to the
  logits of the base's own unbiased forward (one forward for every beta);
* ``displacement[beta][layer]``: the bias at every MoE layer at once, as training applies it, so
  later layers see the biased earlier ones (one forward per beta); compared with the unbiased
  forward's selection, token by token;
* ``group_displacement`` (group-limited routers: the kept groups change), ``overlap_with_base``
  (|biased ∩ base set| / k), ``prior_token_agreement`` (the span prior's top-k against each token's
  own set: the native selection, and the top-k of the base's probabilities under the prior's
  transform, which leaves the expert bias out), and the entropy of the clipped prior q the bias is
  made of.

The bias goes through the training path itself: an ``rpb`` anchor per beta, its ``prior_choice``
for the counterfactual, and ``applied_in_eval`` for the propagated forwards. Every ratio carries a
95% interval from a bootstrap over the sampled rows. ``recommended_beta`` is ``rule.py``'s.
"""

from __future__ import annotations

import math
import random
from dataclasses import dataclass
from pathlib import Path

import torch
from tqdm.auto import tqdm

from rpb.adapters import MoELayer, find_moe_layers, routers_sha256
from rpb.anchors import AnchorConfig, AnchorHandle, RunFacts, install_anchor, verify_prior
from rpb.calibrate import rule
from rpb.calibrate.measure import SUBSETS, RowSums, ratio_with_ci, same_sets, set_overlap
from rpb.collect.collector import plan_batches
from rpb.collect.rows import RowIndex, label_rows, scan_rows
from rpb.data import ChatTemplate, Example, collate
from rpb.errors import ArgumentError
from rpb.models import load_base_model, load_tokenizer, pad_id_of
from rpb.observe.trace import RouterTap, route_batch
from rpb.prior import DEFAULT_CLIP, DEFAULT_EPS, clip_prior, router_probs
from rpb.prior.artifact import prior_kind_of
from rpb.prior.checks import load_prior
from rpb.retention.metrics import entropy_bits
from rpb.routing import select_with_groups

DEFAULT_BETAS = (0.1, 0.25, 0.5, 1.0, 2.0)
DEFAULT_ROWS = 256
SCHEMA = "rpb_calibrate"


def check_arguments(betas, rows: int | None) -> list[float]:
    """The betas as floats, or an ArgumentError naming every problem."""
    problems = []
    betas = [float(b) for b in betas]
    if not betas:
        problems.append("--betas: give at least one beta")
    if any(math.isnan(b) for b in betas):
        problems.append(f"--betas: NaN is not a beta ({betas})")
    if any(b < 0 for b in betas):
        problems.append(f"--betas: must be >= 0, got {[b for b in betas if b < 0]}")
    if len(set(betas)) != len(betas):
        problems.append(f"--betas: each beta once, got {betas}")
    if rows is not None and rows < 1:
        problems.append(f"--rows: must be >= 1, got {rows}")
    if problems:
        raise ArgumentError("; ".join(problems))
    return betas


@dataclass
class Sample:
    """The sampled rows, their prior rows, and where each token of a batch belongs."""

    indices: list[int]  # rows of the data file, ascending
    examples: list[Example]
    pi_RSLE: torch.Tensor  # the prior of those rows (read from the memory-mapped artifact)

    def tokens(self, batch: dict) -> dict[str, torch.Tensor]:
        """Per token of a collated batch: its position in the sample (row_T), span, content mask, and the
        ``[B, T]`` tensors an anchor's step context takes."""
        position = {index: r for r, index in enumerate(self.indices)}
        mask_BT = batch["attention_mask"].bool()
        rows_B = torch.tensor([position[int(i)] for i in batch["sample_index"]])
        sample_BT = torch.where(mask_BT, batch["sample_index"][:, None], torch.tensor(-1))
        span_T = batch["span_ids"].reshape(-1)
        return {
            "row_T": rows_B[:, None].expand_as(mask_BT).reshape(-1),
            "span_T": span_T,
            "content_T": (span_T >= 0) & mask_BT.reshape(-1),
            "step": (sample_BT, batch["span_ids"], batch["attention_mask"]),
        }


class Counter:
    """Per-row sums of every statistic (``measure.RowSums``), for ``len(betas)`` betas and L layers."""

    def __init__(self, betas: int, rows: int, layers: int):
        self.content = RowSums(1, rows, layers)
        self.sums = {
            name: RowSums(betas, rows, layers)
            for name in ("cf_changed", "cf_overlap", "cf_groups", "changed", "overlap")
        }
        self.agreement = {name: RowSums(1, rows, layers) for name in ("native", "probs")}


def _layer_tokens(tok: dict, device) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    keep = tok["content_T"].to(device)
    return keep, tok["row_T"].to(device)[keep], tok["span_T"].to(device)[keep]


def counterfactual_pass(
    model,
    layers: list[MoELayer],
    handles: list[AnchorHandle],
    sample: Sample,
    counter: Counter,
    transform: str,
    batch_size: int,
    pad_id: int,
    progress: bool,
) -> None:
    """One unbiased forward per batch; every beta's choice layer by layer on its logits; agreement."""
    top_k = handles[0].layers[0].spec.top_k
    batches = plan_batches([len(e) for e in sample.examples], batch_size)
    for positions in tqdm(batches, desc="calibrate: counterfactual", unit="batch", disable=not progress):
        batch = collate([sample.examples[i] for i in positions], pad_id)
        tok = sample.tokens(batch)
        with RouterTap(layers) as tap:
            route_batch(model, batch)
        for pos in range(len(layers)):
            logits_TE, native_TK = tap.logits[pos], tap.topk_ids[pos]
            keep, row, span = _layer_tokens(tok, logits_TE.device)
            E = logits_TE.shape[-1]
            counter.content.add(0, pos, row, span, torch.ones_like(row))
            spec, expert_bias = handles[0].layers[pos].spec, handles[0].layers[pos].expert_bias_E
            native_groups = select_with_groups(logits_TE, spec, None, expert_bias)[1]
            for q, handle in enumerate(handles):
                with handle.step(*tok["step"]) as ctx:
                    ids_TK, kept_TG = handle.prior_choice(pos, logits_TE, ctx)
                counter.sums["cf_changed"].add(q, pos, row, span, ~same_sets(ids_TK, native_TK)[keep])
                counter.sums["cf_overlap"].add(q, pos, row, span, set_overlap(ids_TK, native_TK, E)[keep])
                if kept_TG is not None:
                    counter.sums["cf_groups"].add(q, pos, row, span, (kept_TG != native_groups).any(-1)[keep])
            prior_TK = sample.pi_RSLE[row.cpu(), span.cpu(), pos].topk(top_k, dim=-1).indices.to(native_TK.device)
            probs_TK = router_probs(logits_TE[keep], transform).topk(top_k, dim=-1).indices
            counter.agreement["native"].add(0, pos, row, span, set_overlap(prior_TK, native_TK[keep], E))
            counter.agreement["probs"].add(0, pos, row, span, set_overlap(prior_TK, probs_TK, E))


def propagated_pass(
    model,
    layers: list[MoELayer],
    handles: list[AnchorHandle],
    sample: Sample,
    counter: Counter,
    batch_size: int,
    pad_id: int,
    progress: bool,
) -> None:
    """Per batch, the unbiased forward, then one forward per beta with the bias at every MoE layer."""
    batches = plan_batches([len(e) for e in sample.examples], batch_size)
    for positions in tqdm(batches, desc="calibrate: propagated", unit="batch", disable=not progress):
        batch = collate([sample.examples[i] for i in positions], pad_id)
        tok = sample.tokens(batch)
        with RouterTap(layers) as tap:
            route_batch(model, batch)
        native = list(tap.topk_ids)
        for q, handle in enumerate(handles):
            with handle.applied_in_eval(), handle.step(*tok["step"]), RouterTap(layers) as tap:
                route_batch(model, batch)
            for pos in range(len(layers)):
                keep, row, span = _layer_tokens(tok, native[pos].device)
                ids_TK, E = tap.topk_ids[pos], tap.logits[pos].shape[-1]
                counter.sums["changed"].add(q, pos, row, span, ~same_sets(ids_TK, native[pos])[keep])
                counter.sums["overlap"].add(q, pos, row, span, set_overlap(ids_TK, native[pos], E)[keep])


def _figures(numerator: RowSums, counter: Counter, seed: int, betas: list[float], scale: float = 1.0) -> dict:
    """{"layers": {beta: {subset: [per layer]}}, "layers_ci": ..., "mean": {beta: {subset: value}}, "mean_ci": ...}."""
    est = ratio_with_ci(numerator.sums_QRSL, counter.content.sums_QRSL[0], seed)
    if not betas:  # a statistic without betas (the prior's agreement)
        return {name: {s: (t[0, x] / scale).tolist() for x, s in enumerate(SUBSETS)} for name, t in est.items()}
    keys = [f"{b:g}" for b in betas]
    return {
        name: {key: {s: (t[q, x] / scale).tolist() for x, s in enumerate(SUBSETS)} for q, key in enumerate(keys)}
        for name, t in est.items()
    }


def prior_entropy(pi_RSLE: torch.Tensor, eps: float, c: float) -> list[float]:
    """Mean entropy (bits) over the sampled rows' spans of the clipped, renormalised q, per layer."""
    return entropy_bits(clip_prior(pi_RSLE, eps, c)).mean(dim=(0, 1)).tolist()


def calibrate(
    model: str,
    prior: str | Path,
    data_jsonl: str | Path,
    out: str | Path | None = None,
    betas=DEFAULT_BETAS,
    rows: int | None = None,
    seed: int = 0,
    batch_size: int = 8,
    eps: float = DEFAULT_EPS,
    c: float = DEFAULT_CLIP,
    tokenizer: str | None = None,
    trust_remote_code: bool = False,
    adapter: str | None = None,
    dtype: str = "float32",
    device: str = "auto",
    progress: bool = True,
) -> dict:
    """Measure the bias at each of ``betas`` on a seeded sample of ``rows`` rows (None: ``DEFAULT_ROWS``, or
    every row of a smaller file); write calibrate.json, calibrate.md and calibrate.png to ``out`` (when
    given) and return the report."""
    betas = check_arguments(betas, rows)
    artifact = load_prior(prior)  # every value checked, before any model loads
    meta = artifact.metadata
    tok = load_tokenizer(tokenizer or model, trust_remote_code)
    template = ChatTemplate(tok, meta.get("chat_template_kwargs"), meta.get("chat_template_date"))  # as collected
    index: RowIndex = scan_rows(data_jsonl, template, meta["max_seq_len"])  # every bad row, before any compute
    if rows is None:
        rows = min(DEFAULT_ROWS, index.num_rows)
    elif rows > index.num_rows:
        raise ArgumentError(f"--rows {rows}: {data_jsonl} has only {index.num_rows} rows")
    base, facts = load_base_model(model, dtype, adapter, device)
    layers = find_moe_layers(base, facts)
    run = RunFacts(
        data_sha256=index.sha256,
        num_rows=index.num_rows,
        model=str(model),
        routers_sha256=routers_sha256(layers, facts),
        tokenizer=str(tokenizer or model),
        chat_template_sha256=template.sha256,
        chat_template_kwargs=template.kwargs,
        top_k=int(getattr(base.config, facts.top_k_config)),
        max_seq_len=meta["max_seq_len"],
        moe_layers=[m.layer_index for m in layers],
        num_experts=int(layers[0].router.weight.shape[0]),
    )
    verify_prior(meta, run, str(prior))  # the same check, and the same errors, as rpb train

    indices = sorted(random.Random(seed).sample(range(index.num_rows), rows))
    sample = Sample(indices, label_rows(index, template, meta["max_seq_len"], indices), artifact.prior_qa[indices])
    handles = [
        install_anchor(base, AnchorConfig(method="rpb", beta=b, eps=eps, c=c), prior=artifact.prior_qa, adapter=adapter)
        for b in betas
    ]
    counter = Counter(len(betas), rows, len(layers))
    pad_id = pad_id_of(tok)
    try:
        counterfactual_pass(
            base, layers, handles, sample, counter, meta["router_transform"], batch_size, pad_id, progress
        )
        propagated_pass(base, layers, handles, sample, counter, batch_size, pad_id, progress)
    finally:
        for handle in handles:
            handle.remove()
    report = build_report(counter, betas, sample, handles[0], seed, eps, c)
    report.update(
        model=str(model),
        prior=str(prior),
        data=str(data_jsonl),
        moe_layers=run.moe_layers,
        top_k=run.top_k,
        num_experts=run.num_experts,
        router_transform=meta["router_transform"],
        prior_kind=prior_kind_of(meta),
    )
    if out is not None:
        from rpb.calibrate.report import write_report

        write_report(report, Path(out))
    return report


def build_report(
    counter: Counter, betas: list[float], sample: Sample, handle: AnchorHandle, seed: int, eps: float, c: float
) -> dict:
    """Every figure of calibrate.json, and the rule's beta."""
    top_k = handle.layers[0].spec.top_k
    grouped = any(layer.spec.group_scoring for layer in handle.layers)
    counterfactual = _figures(counter.sums["cf_changed"], counter, seed, betas)
    entropy = prior_entropy(sample.pi_RSLE, eps, c)
    by_beta = {b: counterfactual["mean"][f"{b:g}"]["both"] for b in betas}
    return {
        "schema": SCHEMA,
        "schema_version": 1,
        "betas": betas,
        "rows": len(sample.indices),
        "seed": seed,
        "sample_rows": sample.indices,
        "eps": eps,
        "c": c,
        "subsets": list(SUBSETS),
        "displacement": _figures(counter.sums["changed"], counter, seed, betas),
        "displacement_counterfactual": counterfactual,
        "group_displacement": _figures(counter.sums["cf_groups"], counter, seed, betas) if grouped else None,
        "overlap_with_base": _figures(counter.sums["overlap"], counter, seed, betas, scale=top_k),
        "overlap_with_base_counterfactual": _figures(counter.sums["cf_overlap"], counter, seed, betas, scale=top_k),
        "prior_token_agreement": {
            name: _figures(sums, counter, seed, [], scale=top_k) for name, sums in counter.agreement.items()
        },
        "prior_entropy_bits": entropy,
        "prior_effective_experts": [2.0**h for h in entropy],
        "rule": rule.describe(),
        "recommended_beta": rule.recommend_beta(by_beta),
    }
