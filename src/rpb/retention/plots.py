"""Retention figures: plain arrays (numpy or torch) in, one PNG per call out.

Shape legend: L = MoE layers, E = routed experts.

Figures are built on ``matplotlib.figure.Figure`` directly, so no pyplot state or interactive
backend is involved; ``savefig`` renders with Agg. Each function returns the path it wrote.
Panels that are compared share one colour scale, so equal colours mean equal values.
"""

from __future__ import annotations

import math
from pathlib import Path

import numpy as np
from matplotlib.figure import Figure
from matplotlib.ticker import MaxNLocator

DPI = 130
#: a co-activation map of more than 64 experts labels at most this many communities, the largest
MAX_COMMUNITY_TICKS = 40
_PANEL_TITLES = ("base", "post-trained")


def _save(fig: Figure, path) -> Path:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=DPI, facecolor="white", bbox_inches="tight", pad_inches=0.15)
    return path


def _numpy(x, dtype=None) -> np.ndarray:
    return np.asarray(x.detach().cpu() if hasattr(x, "detach") else x, dtype=dtype)


def _as_2d(name: str, x) -> np.ndarray:
    arr = _numpy(x, np.float64)
    if arr.ndim != 2:
        raise ValueError(f"{name} must be 2-D, got shape {arr.shape}")
    return arr


def _vmax(*arrays: np.ndarray) -> float:
    finite = [a[np.isfinite(a)] for a in arrays]
    top = max((float(a.max()) for a in finite if a.size), default=0.0)
    return top if top > 0 else 1.0


def _panels(matrices: list[np.ndarray]) -> list[tuple[str, np.ndarray]]:
    return list(zip(_PANEL_TITLES[: len(matrices)], matrices, strict=True))


# --------------------------------------------------------------------------- utilization


def plot_utilization(util_base_LE, util_post_LE, layer_labels: list[int], path) -> Path:
    """Heatmap MoE layer x expert of utilization shares (rows sum to 1); base beside post when given."""
    mats = [_as_2d("util_base_LE", util_base_LE)]
    if util_post_LE is not None:
        mats.append(_as_2d("util_post_LE", util_post_LE))
        if mats[1].shape != mats[0].shape:
            raise ValueError(f"utilization shapes differ: {mats[0].shape} vs {mats[1].shape}")
    L, E = mats[0].shape
    if len(layer_labels) != L:
        raise ValueError(f"{len(layer_labels)} layer labels for {L} layers")

    panel_w = min(7.0, max(3.5, 0.1 * E + 1.5))
    fig = Figure(figsize=(panel_w * len(mats) + 1.6, max(3.0, 0.24 * L + 1.6)), layout="constrained")
    axes = fig.subplots(1, len(mats), sharey=True, squeeze=False)[0]
    vmax = _vmax(*mats)
    ystep = max(1, math.ceil(L / 40))
    for ax, (title, mat) in zip(axes, _panels(mats), strict=True):
        im = ax.imshow(mat, aspect="auto", interpolation="nearest", cmap="viridis", vmin=0.0, vmax=vmax)
        ax.set_title(title)
        ax.set_xlabel("expert")
        ax.xaxis.set_major_locator(MaxNLocator(nbins=16, integer=True))
        ax.set_yticks(range(0, L, ystep), [str(layer_labels[i]) for i in range(0, L, ystep)])
        ax.tick_params(labelsize=8)
    axes[0].set_ylabel("MoE layer")
    cbar = fig.colorbar(im, ax=list(axes), shrink=0.9, pad=0.02)
    if vmax >= 1.0 / E:
        cbar.ax.axhline(1.0 / E, color="white", linewidth=1.5, linestyle="--")
        cbar.set_label(f"utilization share (dashed: uniform 1/{E})")
    else:
        cbar.set_label("utilization share")
    fig.suptitle(f"Per-expert utilization share ({E} experts, {L} MoE layers)")
    return _save(fig, path)


# --------------------------------------------------------------------------- co-activation


def community_order(labels_E) -> np.ndarray:
    """Expert ids sorted by community label, ties by expert id."""
    labels_E = np.asarray(labels_E).reshape(-1)
    return np.lexsort((np.arange(labels_E.shape[0]), labels_E))


def plot_coactivation(w_base_EE, w_post_EE, labels_base_E, layer: int, path, title: str | None = None) -> Path:
    """Eq. 1 co-activation weights (or, with ``title``, another [E, E] expert graph such as the directed
    transition W, rows = from), experts ordered by base community (then id); lines mark community bounds."""
    mats = [_as_2d("w_base_EE", w_base_EE)]
    if w_post_EE is not None:
        mats.append(_as_2d("w_post_EE", w_post_EE))
    E = mats[0].shape[0]
    if any(m.shape != (E, E) for m in mats):
        raise ValueError(f"co-activation matrices must be square and alike, got {[m.shape for m in mats]}")
    labels_E = _numpy(labels_base_E).reshape(-1)
    if labels_E.shape[0] != E:
        raise ValueError(f"{labels_E.shape[0]} community labels for {E} experts")

    order_E = community_order(labels_E)
    sorted_labels = labels_E[order_E]
    bounds = np.flatnonzero(sorted_labels[1:] != sorted_labels[:-1]) + 0.5
    n_comm = len(bounds) + 1

    side = min(7.5, max(4.5, 0.1 * E + 1.5))
    fig = Figure(figsize=(side * len(mats) + 1.4, side + 0.8), layout="constrained")
    axes = fig.subplots(1, len(mats), squeeze=False)[0]
    vmax = _vmax(*mats)
    fontsize = min(8.0, max(4.0, 360.0 / E))
    for ax, (title, mat) in zip(axes, _panels(mats), strict=True):
        im = ax.imshow(mat[np.ix_(order_E, order_E)], interpolation="nearest", cmap="magma", vmin=0.0, vmax=vmax)
        # one artist per direction: hundreds of communities (isolated experts of a 384-expert layer) stay fast
        ax.hlines(bounds, -0.5, E - 0.5, colors="white", linewidth=0.7)
        ax.vlines(bounds, -0.5, E - 0.5, colors="white", linewidth=0.7)
        ax.set_title(title)
        ax.set_xlabel("expert (ordered by base community)")
        ax.set_ylabel("expert (ordered by base community)")
        if E <= 64:
            ax.set_xticks(range(E), [str(e) for e in order_E], rotation=90, fontsize=fontsize)
            ax.set_yticks(range(E), [str(e) for e in order_E], fontsize=fontsize)
        else:
            starts = np.concatenate([[0], np.ceil(bounds).astype(int), [E]])
            # the largest communities only: hundreds of labels (isolated experts) would overprint, and slowly
            shown = np.sort(np.argsort(-(starts[1:] - starts[:-1]), kind="stable")[:MAX_COMMUNITY_TICKS])
            centres = (starts[shown] + starts[shown + 1] - 1) / 2
            names = [f"c{sorted_labels[starts[c]]}" for c in shown]
            ax.set_xticks(centres, names, fontsize=7)
            ax.set_yticks(centres, names, fontsize=7)
    cbar = fig.colorbar(im, ax=list(axes), shrink=0.85, pad=0.02)
    cbar.set_label("co-activation weight $w_{ij}$ (share of tokens)" if title is None else "weight")
    fig.suptitle(f"{title or 'Expert co-activation'}, layer {layer} ({n_comm} base communities)")
    return _save(fig, path)


# --------------------------------------------------------------------------- per-layer bars


def _layer_values(report: dict, key: str) -> np.ndarray:
    return np.array([np.nan if r.get(key) is None else float(r[key]) for r in report["layers"]], dtype=np.float64)


def _mean(report: dict, key: str, values: np.ndarray) -> float:
    m = report.get("mean", {}).get(key)
    if m is None:
        return float(np.nanmean(values)) if np.isfinite(values).any() else math.nan
    return float(m)


def _bars(ax, values: np.ndarray, mean: float, colour: str, title: str, ylim: tuple[float, float]) -> None:
    x = np.arange(len(values))
    ax.bar(x, np.nan_to_num(values, nan=0.0), color=colour, width=0.75)
    for i in np.flatnonzero(~np.isfinite(values)):
        ax.text(i, ylim[0] + 0.02 * (ylim[1] - ylim[0]), "n/a", ha="center", va="bottom", fontsize=7, color="0.3")
    if math.isfinite(mean):
        ax.axhline(mean, color="black", linestyle="--", linewidth=1.0, label=f"mean {mean:.3f}")
    else:
        ax.plot([], [], color="black", linestyle="--", linewidth=1.0, label="mean n/a")
    ax.set_ylim(*ylim)
    ax.set_title(title, fontsize=10, loc="left")
    ax.grid(axis="y", alpha=0.3)
    ax.legend(loc="upper left", bbox_to_anchor=(1.01, 1.0), fontsize=8, frameon=False)


def plot_layer_bars(report: dict, path) -> Path:
    """Per-layer TVD, top-k overlap and NMI (or base entropy and modularity when there is no post model)."""
    layers = [int(r["layer"]) for r in report["layers"]]
    L = len(layers)
    if report.get("post") is not None:
        panels = [
            ("tvd", "C3", "TVD of utilization shares (0 = same utilization)", (0.0, 1.0)),
            ("topk_overlap", "C0", "top-k overlap per token (1 = same experts)", (0.0, 1.0)),
            ("nmi", "C2", "NMI of Louvain communities (1 = same communities)", (0.0, 1.0)),
        ]
        title = "Routing retention per MoE layer"
    else:
        max_bits = math.log2(report["num_experts"]) if report.get("num_experts") else 1.0
        mod = _layer_values(report, "modularity_base")
        low = min(0.0, float(np.nanmin(mod))) if np.isfinite(mod).any() else 0.0
        panels = [
            ("entropy_base_bits", "C4", f"utilization entropy, bits (uniform = {max_bits:.2f})", (0.0, max_bits)),
            ("modularity_base", "C1", "modularity of Louvain communities (bar label: communities)", (low, 1.0)),
        ]
        title = "Base routing per MoE layer"

    fig = Figure(figsize=(max(6.5, 0.28 * L + 3.0), 2.4 * len(panels) + 0.8), layout="constrained")
    axes = fig.subplots(len(panels), 1, sharex=True, squeeze=False)[:, 0]
    for ax, (key, colour, panel_title, ylim) in zip(axes, panels, strict=True):
        values = _layer_values(report, key)
        _bars(ax, values, _mean(report, key, values), colour, panel_title, ylim)
        if key == "modularity_base":
            counts = [r.get("communities_base") for r in report["layers"]]
            labels = ["" if c is None else str(int(c)) for c in counts]
            ax.bar_label(ax.containers[0], labels=labels, fontsize=7, padding=1)
    step = max(1, math.ceil(L / 40))
    axes[-1].set_xticks(range(0, L, step), [str(layers[i]) for i in range(0, L, step)], fontsize=8)
    axes[-1].set_xlim(-0.6, L - 0.4)
    axes[-1].set_xlabel("model layer")
    fig.suptitle(title)
    return _save(fig, path)
