"""calibrate.json, calibrate.md and calibrate.png from the report dict (``run.build_report``).

The heatmap is MoE layer x beta, counterfactual beside propagated, on one colour scale from 0
(the bias moves nothing) to 1 (it moves every content token); at 60 layers the layer ticks thin
out and the cells stay unlabelled, below 25 layers each cell carries its value.
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import numpy as np
from matplotlib.figure import Figure

from rpb.fileio import output_folder
from rpb.retention.markdown import fmt, table

LABELLED_LAYERS = 25


def _ci(value: float, ci: list[float], digits: int = 3) -> str:
    return f"{fmt(value, digits)} [{fmt(ci[0], digits)}, {fmt(ci[1], digits)}]"


def _beta_rows(report: dict, betas: list[str]) -> tuple[list[str], list[list[str]]]:
    d, cf, ov = report["displacement"], report["displacement_counterfactual"], report["overlap_with_base"]
    groups = report["group_displacement"]
    header = ["beta", "displacement", "counterfactual", "displacement Q", "displacement A", "overlap with base"]
    rows = []
    for b in betas:
        row = [
            b,
            _ci(d["mean"][b]["both"], d["mean_ci"][b]["both"]),
            _ci(cf["mean"][b]["both"], cf["mean_ci"][b]["both"]),
        ]
        row += [fmt(d["mean"][b]["Q"], 3), fmt(d["mean"][b]["A"], 3)]
        row += [_ci(ov["mean"][b]["both"], ov["mean_ci"][b]["both"])]
        rows.append(row + ([fmt(groups["mean"][b]["both"], 3)] if groups is not None else []))
    return header + (["group displacement"] if groups is not None else []), rows


def _layer_rows(report: dict, betas: list[str]) -> tuple[list[str], list[list[str]]]:
    d, agree = report["displacement"], report["prior_token_agreement"]
    header = ["layer", *(f"beta {b}" for b in betas)]
    header += ["prior ∩ native / k", "prior ∩ probs / k", "q entropy (bits)", "effective experts"]
    rows = []
    for i, layer in enumerate(report["moe_layers"]):
        row = [str(layer), *(fmt(d["layers"][b]["both"][i], 3) for b in betas)]
        row += [fmt(agree[name]["layers"]["both"][i], 3) for name in ("native", "probs")]
        rows.append([*row, fmt(report["prior_entropy_bits"][i], 2), fmt(report["prior_effective_experts"][i], 1)])
    return header, rows


LEGEND = (
    "**displacement**: fraction of content tokens whose selected expert set the bias changes, with the bias at "
    "every MoE layer as in training; **counterfactual**: the bias at one layer at a time on the base's own "
    "logits; **overlap with base**: |biased ∩ base| / k. **prior ∩ native**: the span prior's top-k against each "
    "token's own selection (expert bias included); **prior ∩ probs**: against the top-k of the base's "
    "probabilities under the prior's transform (no expert bias); **q entropy**: of the clipped, renormalised "
    "prior the bias is made of (log2 E is uniform)."
)


def render_markdown(report: dict) -> str:
    betas = [f"{b:g}" for b in report["betas"]]
    rule = report["rule"]
    lines = [
        "# Calibration: the prior bias on the frozen base",
        "",
        f"- **model**: `{report['model']}`; **prior**: `{report['prior']}` "
        f"({report.get('prior_kind', 'probability')}); **data**: `{report['data']}`",
        f"- **rows**: {report['rows']} sampled (seed {report['seed']}); eps {report['eps']:g}, C {report['c']:g}; "
        f"top-{report['top_k']} of {report['num_experts']} experts, {len(report['moe_layers'])} MoE layers",
        f"- **recommended beta: {report['recommended_beta']:g}** (the largest candidate before the first whose "
        f"mean counterfactual displacement exceeds {rule['limit']:g}; `{rule['source']}`, "
        f"sha256 {rule['source_sha256'][:12]})",
        "",
        "## By beta (means over MoE layers, content tokens; 95% bootstrap intervals over rows)",
        "",
        *table(*_beta_rows(report, betas), numbers=False),
        "",
        "## By layer (displaced content tokens; the prior's agreement and entropy)",
        "",
        *table(*_layer_rows(report, betas), numbers=False),
        "",
        LEGEND,
        "",
        "![displacement by layer and beta](calibrate.png)",
        "",
    ]
    return "\n".join(lines)


def plot_heatmap(report: dict, path: Path) -> Path:
    betas = [f"{b:g}" for b in report["betas"]]
    layers = report["moe_layers"]
    L = len(layers)
    panels = [
        ("counterfactual (one layer at a time)", report["displacement_counterfactual"]),
        ("propagated (every layer, as training)", report["displacement"]),
    ]
    fig = Figure(figsize=(2.2 + 1.1 * len(betas) * 2, max(3.0, 0.16 * L + 1.6)), layout="constrained")
    axes = fig.subplots(1, 2, sharey=True)
    for ax, (title, figures) in zip(axes, panels, strict=True):
        mat = np.array([[figures["layers"][b]["both"][i] for b in betas] for i in range(L)])
        image = ax.imshow(mat, aspect="auto", vmin=0.0, vmax=1.0, cmap="magma_r", interpolation="nearest")
        ax.set_xticks(range(len(betas)), betas)
        ax.set_xlabel("beta")
        ax.set_title(title, fontsize=9)
        if L <= LABELLED_LAYERS:
            for i in range(L):
                for j in range(len(betas)):
                    ax.text(
                        j,
                        i,
                        f"{mat[i, j]:.2f}",
                        ha="center",
                        va="center",
                        fontsize=7,
                        color="white" if mat[i, j] > 0.55 else "black",
                    )
    step = max(1, math.ceil(L / 30))
    axes[0].set_yticks(range(0, L, step), [str(layers[i]) for i in range(0, L, step)], fontsize=7)
    axes[0].set_ylabel("MoE layer (model layer index)")
    fig.colorbar(image, ax=axes, label="displaced content tokens (fraction)", shrink=0.8)
    fig.suptitle("How far the prior bias moves the base's own expert choice")
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=130, facecolor="white")
    return path


#: what `rpb calibrate --out` holds
FILES = ("calibrate.json", "calibrate.md", "calibrate.png")


def write_report(report: dict, out: Path) -> None:
    """The three files, published together (``output_folder``: a kill leaves the previous result or none)."""
    with output_folder(out, FILES.__contains__) as tmp:
        plot_heatmap(report, tmp / "calibrate.png")
        (tmp / "calibrate.md").write_text(render_markdown(report), encoding="utf-8")
        (tmp / "calibrate.json").write_text(json.dumps(report, indent=1), encoding="utf-8")
