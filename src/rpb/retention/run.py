"""``rpb retention``: base vs post-training routing, bias-free, on exactly the same tokens.

Both models run in eval mode (no anchor is installed, so no training-time prior is
involved) over the same collated batches; per MoE layer it accumulates utilization
counts (all / Q / A tokens), co-activation counts (eq. 1) and the paired top-k overlap,
then finds seeded Louvain communities and compares them by NMI. With no post model it
describes the base alone.
"""

from __future__ import annotations

import json
import math
import random
from pathlib import Path

import torch
from tqdm.auto import tqdm

from rpb.adapters import find_moe_layers
from rpb.data import collate, load_labelled
from rpb.errors import ArgumentError, RpbError
from rpb.fileio import output_folder
from rpb.models import load_base_model, load_tokenizer, pad_id_of
from rpb.observe.trace import RouterTap, route_batch
from rpb.retention.communities import louvain, nmi
from rpb.retention.metrics import entropy_bits, jsd_bits, shares, tvd
from rpb.retention.stats import SUBSETS, ModelRouting, PairedOverlap
from rpb.retention.transitions import self_share, step_ids, transition_row_jsd, transition_tvd

SCHEMA = "rpb_retention"


class RoutingMismatchError(RpbError):
    """Two models whose routing cannot be compared (other MoE layers, experts or top-k)."""


def _describe(model, facts, layers) -> dict:
    return {
        "moe_layers": [m.layer_index for m in layers],
        "num_experts": int(layers[0].router.weight.shape[0]),
        "top_k": int(getattr(model.config, facts.top_k_config)),
    }


def check_comparable(base: dict, post: dict) -> None:
    """Refuse two models whose routing cannot be compared, naming every difference."""
    diffs = [f"{k}: base {base[k]!r}, post {post[k]!r}" for k in base if base[k] != post[k]]
    if diffs:
        raise RoutingMismatchError("the two models route differently shaped: " + "; ".join(diffs))


def select_rows(num_rows: int, max_rows: int | None, seed: int) -> list[int]:
    """All rows, or a seeded sample of ``max_rows`` of them in file order."""
    if max_rows is None or max_rows >= num_rows:
        return list(range(num_rows))
    if max_rows < 1:
        raise ArgumentError(f"--max-rows must be >= 1, got {max_rows}")
    return sorted(random.Random(seed).sample(range(num_rows), max_rows))


def collect_routing(
    models: list,
    layers: list,
    examples,
    batch_size: int,
    pad_id: int,
    progress: bool,
    transitions: bool = False,
    steps: list[list[int]] | None = None,
):
    """Stream the batches through every model; returns per-model ModelRouting and the paired overlap.
    ``steps``: each example's per-token answer step (``transitions.step_ids``) for the step level."""
    num_layers, num_experts = len(layers[0]), int(layers[0][0].router.weight.shape[0])
    stats = [ModelRouting(num_layers, num_experts, transitions, steps is not None) for _ in models]
    overlap = PairedOverlap(num_layers, num_experts) if len(models) == 2 else None
    taps = [RouterTap(lay) for lay in layers]
    bar = tqdm(total=sum(len(e) for e in examples), unit="tok", desc="retention", disable=not progress)
    for tap in taps:
        tap.__enter__()
    try:
        for start in range(0, len(examples), batch_size):
            b = collate(examples[start : start + batch_size], pad_id)
            valid_T, span_T = b["attention_mask"].reshape(-1).bool(), b["span_ids"].reshape(-1)
            step_BT = None
            if steps is not None:
                step_BT = torch.full_like(b["span_ids"], -1)
                for i, row in enumerate(steps[start : start + batch_size]):
                    step_BT[i, : len(row)] = torch.tensor(row)
            for model in models:
                route_batch(model, b)
            for pos in range(num_layers):
                ids = [tap.topk_ids[pos].cpu() for tap in taps]
                for st, ids_TK in zip(stats, ids, strict=True):
                    st.add(pos, ids_TK, valid_T, span_T, rows=b["input_ids"].shape[0], step_BT=step_BT)
                if overlap is not None:
                    overlap.add(pos, ids[0], ids[1], valid_T, span_T)
            bar.update(int(valid_T.sum()))
    finally:
        for tap in taps:
            tap.__exit__(None, None, None)
        bar.close()
    return stats, overlap


def build_report(info: dict, stats: list[ModelRouting], overlap: PairedOverlap | None, seed, resolution) -> dict:
    base = stats[0]
    post = stats[1] if len(stats) == 2 else None
    for name, st in zip(("base", "post"), stats, strict=False):
        if int(st.tokens_S[0]) == 0:
            raise ValueError(f"empty selection: no routed tokens for the {name} model")
    layers, communities = [], {"base": [], "post": []}
    for pos, layer_index in enumerate(info["moe_layers"]):
        p_all = shares(base.load_SLE[0, pos])
        lab_b, q_b = louvain(base.coactivation.graph(pos), seed=seed, resolution=resolution)
        communities["base"].append(lab_b.tolist())
        row = {
            "layer": layer_index,
            "entropy_base_bits": float(entropy_bits(p_all)),
            "communities_base": int(lab_b.max()) + 1,
            "modularity_base": q_b,
        }
        if post is not None:
            lab_p, q_p = louvain(post.coactivation.graph(pos), seed=seed, resolution=resolution)
            communities["post"].append(lab_p.tolist())
            q_all = shares(post.load_SLE[0, pos])
            row.update(
                entropy_post_bits=float(entropy_bits(q_all)), communities_post=int(lab_p.max()) + 1, modularity_post=q_p
            )
            for s, suffix in enumerate(("", "_q", "_a")):
                if int(base.tokens_S[s]) == 0:
                    row[f"tvd{suffix}"] = row[f"jsd{suffix}"] = row[f"topk_overlap{suffix}"] = math.nan
                    continue
                ps, qs = shares(base.load_SLE[s, pos]), shares(post.load_SLE[s, pos])
                row[f"tvd{suffix}"], row[f"jsd{suffix}"] = tvd(ps, qs), jsd_bits(ps, qs)
                row[f"topk_overlap{suffix}"] = float(overlap.mean_SL()[s, pos])
            row["nmi"] = nmi(lab_b, lab_p)
        if base.transitions is not None:
            row.update(transition_figures(base, post, pos, seed, resolution, communities))
        if base.step_transitions is not None:
            row.update(transition_figures(base, post, pos, seed, resolution, communities, "step_transitions"))
        layers.append(row)
    keys = [k for k in layers[0] if k != "layer"]
    mean = {k: _nanmean([r[k] for r in layers]) for k in keys}
    return {
        "schema": SCHEMA,
        "schema_version": 1,
        **info,
        "tokens": {name: int(base.tokens_S[s]) for s, name in enumerate(SUBSETS)},
        "seed": seed,
        "resolution": resolution,
        "layers": layers,
        "mean": mean,
        "communities": communities if post is not None else {k: v for k, v in communities.items() if "post" not in k},
    }


def transition_figures(
    base: ModelRouting, post: ModelRouting | None, pos: int, seed, resolution, communities, level: str = "transitions"
) -> dict:
    """The fourth level (``rpb.retention.transitions``): directed transition communities of the base (and
    their NMI with the post-trained model's), the TVD of the two W and the utilization-weighted row JSD;
    ``level="step_transitions"`` gives the same figures for the step level, prefixed ``step_``."""
    prefix = "step_" if level == "step_transitions" else ""
    if int(getattr(base, level).steps_L[pos]) == 0:  # no consecutive answer tokens (or steps) to count
        keys = ["communities_base", "modularity_base", "self_share_base"]
        keys += ["nmi", "tvd", "row_jsd", "self_share_post"] if post is not None else []
        communities.setdefault(f"{prefix}transitions_base", []).append(None)
        return {f"{prefix}transition_{k}": math.nan for k in keys}
    w_b = getattr(base, level).graph(pos)
    lab_b, q_b = louvain(w_b, seed=seed, resolution=resolution, directed=True)
    communities.setdefault(f"{prefix}transitions_base", []).append(lab_b.tolist())
    row = {
        "transition_communities_base": int(lab_b.max()) + 1,
        "transition_modularity_base": q_b,
        "transition_self_share_base": self_share(w_b),
    }
    if post is not None:
        w_p = getattr(post, level).graph(pos)
        lab_p, _ = louvain(w_p, seed=seed, resolution=resolution, directed=True)
        communities.setdefault(f"{prefix}transitions_post", []).append(lab_p.tolist())
        row.update(
            transition_nmi=nmi(lab_b, lab_p),
            transition_tvd=transition_tvd(w_b, w_p),
            transition_row_jsd=transition_row_jsd(w_b, w_p, base.load_SLE[0, pos]),
            transition_self_share_post=self_share(w_p),
        )
    return {f"{prefix}{k}": v for k, v in row.items()}


def _nanmean(values: list[float]) -> float:
    kept = [v for v in values if not math.isnan(v)]
    return sum(kept) / len(kept) if kept else math.nan


def _json_safe(obj):
    """NaN is not JSON: write it as null."""
    if isinstance(obj, float) and math.isnan(obj):
        return None
    if isinstance(obj, dict):
        return {k: _json_safe(v) for k, v in obj.items()}
    if isinstance(obj, list):
        return [_json_safe(v) for v in obj]
    return obj


def run_retention(
    base: str,
    data_jsonl: str | Path,
    out_dir: str | Path,
    post: str | None = None,
    max_rows: int | None = None,
    seed: int = 0,
    resolution: float = 1.0,
    batch_size: int = 8,
    max_seq_len: int = 2048,
    tokenizer: str | None = None,
    adapter: str | None = None,
    dtype: str = "float32",
    device: str = "auto",
    progress: bool = True,
    transitions: bool = False,
    steps_by: str | None = None,
    chat_template_kwargs: dict | None = None,
) -> dict:
    """Compute, write and return the retention report (report.json, report.md, PNGs in ``out_dir``)."""
    tok = load_tokenizer(tokenizer or base)
    data = load_labelled(data_jsonl, tok, max_seq_len, chat_template_kwargs)  # every bad row, before any compute
    rows = select_rows(data.num_rows, max_rows, seed)
    examples = [data.examples[i] for i in rows]
    models, layers, described = [], [], []
    for path in [base] + ([post] if post else []):
        model, facts = load_base_model(path, dtype, adapter, device)
        lay = find_moe_layers(model, facts)
        models.append(model)
        layers.append(lay)
        described.append(_describe(model, facts, lay))
    if post:
        check_comparable(described[0], described[1])
    steps = None
    if steps_by is not None:  # the step level comes with the token level
        transitions = True
        steps = [step_ids(e.input_ids, e.span_ids, lambda i: tok.decode([i]), steps_by) for e in examples]
    stats, overlap = collect_routing(models, layers, examples, batch_size, pad_id_of(tok), progress, transitions, steps)
    info = {
        "base": str(base),
        "post": str(post) if post else None,
        "data": str(data_jsonl),
        "rows": len(rows),
        **described[0],
        **({"steps_by": steps_by} if steps_by else {}),
        **data.template_settings,
    }
    report = build_report(info, stats, overlap, seed, resolution)

    with output_folder(out_dir, _owned) as out:  # published whole: a kill leaves the previous report or none
        _write(report, stats, layers, info, post, transitions, out)
    return report


def _owned(name: str) -> bool:
    """What `rpb retention --out` holds."""
    return name in ("report.json", "report.md") or name.endswith(".png")


def _write(report: dict, stats, layers, info: dict, post, transitions: bool, out: Path) -> None:
    from rpb.retention.markdown import write_markdown
    from rpb.retention.plots import plot_coactivation, plot_layer_bars, plot_utilization

    util = [torch.stack([torch.tensor(shares(st.load_SLE[0, p])) for p in range(len(layers[0]))]) for st in stats]
    images = {
        "utilization": plot_utilization(
            util[0], util[1] if post else None, info["moe_layers"], out / "utilization.png"
        ),
        "layers": plot_layer_bars(report, out / "layers.png"),
    }
    for pos, layer_index in enumerate(info["moe_layers"]):
        images[f"coactivation_layer{layer_index}"] = plot_coactivation(
            stats[0].coactivation.graph(pos),
            stats[1].coactivation.graph(pos) if post else None,
            torch.tensor(report["communities"]["base"][pos]),
            layer_index,
            out / f"coactivation_layer{layer_index}.png",
        )
        if transitions:
            images[f"transitions_layer{layer_index}"] = plot_coactivation(
                stats[0].transitions.graph(pos),
                stats[1].transitions.graph(pos) if post else None,
                torch.tensor(report["communities"]["transitions_base"][pos]),
                layer_index,
                out / f"transitions_layer{layer_index}.png",
                title="expert transitions W[from, to]",
            )
    images = {k: Path(v).name for k, v in images.items()}
    (out / "report.json").write_text(json.dumps(_json_safe(report), indent=1), encoding="utf-8")
    write_markdown(report, images, out / "report.md")
