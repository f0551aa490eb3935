"""Retention report as Markdown, rendered from the plain report dict (the content of report.json).

Numbers use fixed decimals (``DIGITS``); NaN or missing values print as ``n/a``. Images are
linked, not inlined: ``images`` maps a name to a PNG path. ``write_markdown`` makes absolute
paths relative to the Markdown file so the report directory can be moved as a whole; relative
paths are taken as already relative to it and are linked as given.
Known image names get a caption: ``utilization``, ``layers`` and ``coactivation_layer<layer>``
(the names ``rpb retention`` writes); other names are shown as they are.
"""

from __future__ import annotations

import math
import os
from pathlib import Path

DIGITS = 4
NA = "n/a"

_CAPTIONS = {
    "utilization": "Per-expert utilization share per MoE layer",
    "layers": "Per-layer metrics",
}

# (column header, layer key, decimals or None for an integer count)
_PAIR_COLUMNS = [
    ("layer", "layer", None),
    ("TVD", "tvd", DIGITS),
    ("JSD", "jsd", DIGITS),
    ("TVD Q", "tvd_q", DIGITS),
    ("TVD A", "tvd_a", DIGITS),
    ("overlap", "topk_overlap", DIGITS),
    ("overlap Q", "topk_overlap_q", DIGITS),
    ("overlap A", "topk_overlap_a", DIGITS),
    ("NMI", "nmi", DIGITS),
    ("modularity base", "modularity_base", DIGITS),
    ("modularity post", "modularity_post", DIGITS),
    ("communities base", "communities_base", None),
    ("communities post", "communities_post", None),
]
_BASE_COLUMNS = [
    ("layer", "layer", None),
    ("entropy (bits)", "entropy_base_bits", DIGITS),
    ("communities", "communities_base", None),
    ("modularity", "modularity_base", DIGITS),
]

_LEGEND_PAIR = """\
- **TVD**: total variation distance ½ Σ_e |u_post(e) − u_base(e)| between the per-expert utilization
  shares u of one layer (each expert's fraction of the layer's top-k selections); 0 = identical, 1 = disjoint.
- **JSD**: Jensen–Shannon divergence of the same shares, log base 2 (bits, in [0, 1]).
- **overlap**: top-k overlap |top_k^base(x_t) ∩ top_k^post(x_t)| / k per token, averaged over tokens;
  1 = both routers pick the same experts for every token.
- **Q / A**: the same metric over question tokens or answer tokens only.
- **NMI**: normalized mutual information between the Louvain community assignments of the base and
  post-trained co-activation graphs (eq. 1: w_ij = (1/N) Σ_t 1{i, j ∈ top_k(x_t)}, i ≠ j); 1 = same partition.
- **modularity / communities**: modularity of the Louvain partition of each graph and its number of communities.
- **entropy**: entropy of the utilization shares in bits; log2(E) means uniform utilization.
- Routing is measured bias-free: no training-time prior bias is applied while the routers are read.
"""
_LEGEND_BASE = """\
- **entropy**: entropy of the per-expert utilization shares (each expert's fraction of the layer's top-k
  selections) in bits; log2(E) means uniform utilization.
- **communities / modularity**: Louvain communities of the co-activation graph
  (eq. 1: w_ij = (1/N) Σ_t 1{i, j ∈ top_k(x_t)}, i ≠ j), their number and the partition's modularity.
- Routing is measured bias-free: no training-time prior bias is applied while the router is read.
"""


def fmt(value, digits: int | None = DIGITS) -> str:
    """``digits`` decimals, an integer when ``digits`` is None; ``n/a`` for None, NaN or inf."""
    if value is None:
        return NA
    value = float(value)
    if not math.isfinite(value):
        return NA
    return str(round(value)) if digits is None else f"{value:.{digits}f}"


def table(header: list[str], rows: list[list[str]], numbers: bool = True) -> list[str]:
    """The lines of a markdown table; ``numbers``: every column after the first is right-aligned (``rpb
    calibrate``'s report, whose cells hold intervals and lists, keeps them all left-aligned)."""
    rule = ["---"] + ["---:" if numbers else "---"] * (len(header) - 1)
    return ["| " + " | ".join(header) + " |", "|" + "|".join(rule) + "|", *("| " + " | ".join(r) + " |" for r in rows)]


def _layer_range(layers: list[int]) -> str:
    if not layers:
        return "none"
    if layers == list(range(layers[0], layers[-1] + 1)) and len(layers) > 2:
        return f"{layers[0]}–{layers[-1]}"
    return ", ".join(str(x) for x in layers)


def _header(report: dict) -> list[str]:
    pair = report.get("post") is not None
    tok = report.get("tokens", {})
    layers = report.get("moe_layers", [])
    title = "# Routing retention: base vs post-trained" if pair else "# Base routing structure"
    lines = [title, "", f"- **base**: `{report['base']}`"]
    if pair:
        lines.append(f"- **post-trained**: `{report['post']}`")
    lines += [
        f"- **data**: `{report['data']}`: {report.get('rows', 0):,} rows, {tok.get('all', 0):,} tokens "
        f"({tok.get('Q', 0):,} question, {tok.get('A', 0):,} answer)",
        f"- **routing**: top-{report['top_k']} of {report['num_experts']} experts, "
        f"{len(layers)} MoE layers (model layers {_layer_range(layers)})",
        f"- **communities**: Louvain, resolution {report['resolution']:g}, seed {report['seed']}",
    ]
    return [*lines, ""]


def _summary(report: dict) -> list[str]:
    mean = report.get("mean", {})
    n = len(report.get("layers", []))
    lines = ["## Summary", "", f"Means over {n} MoE layers.", ""]
    if report.get("post") is not None:
        rows = [
            ["TVD", *(fmt(mean.get(k)) for k in ("tvd", "tvd_q", "tvd_a"))],
            ["JSD (bits)", *(fmt(mean.get(k)) for k in ("jsd", "jsd_q", "jsd_a"))],
            ["top-k overlap", *(fmt(mean.get(k)) for k in ("topk_overlap", "topk_overlap_q", "topk_overlap_a"))],
            ["NMI", fmt(mean.get("nmi")), "", ""],
        ]
        lines += [*table(["retention", "all tokens", "Q tokens", "A tokens"], rows), ""]
        rows = [
            [name, fmt(mean.get(base), d), fmt(mean.get(post), d)]
            for name, base, post, d in (
                ("utilization entropy (bits)", "entropy_base_bits", "entropy_post_bits", DIGITS),
                ("communities", "communities_base", "communities_post", 2),
                ("modularity", "modularity_base", "modularity_post", DIGITS),
            )
        ]
        lines += [*table(["structure", "base", "post-trained"], rows), ""]
    else:
        rows = [
            ["utilization entropy (bits)", fmt(mean.get("entropy_base_bits"))],
            ["communities", fmt(mean.get("communities_base"), 2)],
            ["modularity", fmt(mean.get("modularity_base"))],
        ]
        lines += [*table(["structure", "base"], rows), ""]
    return lines


def _per_layer(report: dict) -> list[str]:
    columns = _PAIR_COLUMNS if report.get("post") is not None else _BASE_COLUMNS
    rows = [[fmt(layer.get(key), d) for _, key, d in columns] for layer in report.get("layers", [])]
    return ["## Per layer", "", *table([c[0] for c in columns], rows), ""]


_TRANSITION_COLUMNS = [
    ("layer", "layer", None),
    ("transition NMI", "transition_nmi", DIGITS),
    ("transition TVD", "transition_tvd", DIGITS),
    ("row JSD", "transition_row_jsd", DIGITS),
    ("communities base", "transition_communities_base", None),
    ("modularity base", "transition_modularity_base", DIGITS),
    ("stay share base", "transition_self_share_base", DIGITS),
    ("stay share post", "transition_self_share_post", DIGITS),
]
_LEGEND_TRANSITIONS = """\
- **transitions** (`--transitions`): per layer, W[e, e'] counts e in S_t and e' in S_{t+1} for consecutive
  answer tokens of a row (k² pairs a step, over the steps counted; the diagonal, an expert that stays,
  is kept). Communities: Louvain on the directed graph (directed modularity).
- **transition NMI**: NMI of the base's and the post-trained model's transition communities.
- **transition TVD**: TVD between the two W, each normalised over its E² cells.
- **row JSD**: Σ_i u_base(i) · JSD(P_base(i, ·), P_post(i, ·)) in bits, P = W row-normalised, u the base's
  utilization (rows a model never leaves are skipped).
- **stay share**: the diagonal's share of W.
- **step transitions** (`--steps-by REGEX`): the same figures on a graph of answer *steps* (cut where REGEX
  matches; a delimiter token ends its step), each consecutive pair adding u_j u_{j+1}ᵀ of the steps' usage.
"""


def _transitions(report: dict) -> list[str]:
    layers = report.get("layers", [])
    out = []
    step_title = f"Step transitions (steps by {report.get('steps_by')!r})"
    for prefix, title in (("", "Transitions (fourth level)"), ("step_", step_title)):
        if not layers or f"{prefix}transition_communities_base" not in layers[0]:
            continue
        columns = [(h, k if k == "layer" else prefix + k, d) for h, k, d in _TRANSITION_COLUMNS]
        columns = [c for c in columns if c[1] in layers[0]]
        rows = [[fmt(layer.get(key), d) for _, key, d in columns] for layer in layers]
        out += [f"## {title}", "", *table([c[0] for c in columns], rows), ""]
    return [*out, _LEGEND_TRANSITIONS] if out else []


def _caption(name: str) -> str:
    if name in _CAPTIONS:
        return _CAPTIONS[name]
    if name.startswith("coactivation_layer"):
        return f"Expert co-activation, layer {name.removeprefix('coactivation_layer')}"
    if name.startswith("transitions_layer"):
        return f"Expert transitions, layer {name.removeprefix('transitions_layer')}"
    return name.replace("_", " ")


def _figures(images: dict, base_dir: Path | None) -> list[str]:
    if not images:
        return []
    lines = ["## Figures", ""]
    for name, img in images.items():
        p = Path(img)
        if base_dir is not None and p.is_absolute():
            p = Path(os.path.relpath(p.resolve(), base_dir))
        lines += [f"### {_caption(name)}", "", f"![{_caption(name)}]({p.as_posix()})", ""]
    return lines


def render_markdown(report: dict, images: dict[str, str], base_dir: str | Path | None = None) -> str:
    """The report as Markdown; absolute image paths are made relative to ``base_dir`` when given."""
    base = Path(base_dir).resolve() if base_dir is not None else None
    legend = _LEGEND_PAIR if report.get("post") is not None else _LEGEND_BASE
    lines = [
        *_header(report),
        *_summary(report),
        *_per_layer(report),
        *_transitions(report),
        "## Metrics",
        "",
        legend,
        *_figures(images, base),
    ]
    return "\n".join(lines).rstrip() + "\n"


def write_markdown(report: dict, images: dict[str, str], path: str | Path) -> Path:
    """Write ``render_markdown`` to ``path``; image paths are linked relative to its folder."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(render_markdown(report, images, base_dir=path.parent), encoding="utf-8")
    return path
