"""The ``rl`` grids' figures, drawn from their cells' records: ``rl.svg``, and (cells that record it: the
``rl-stale`` grid's) ``stale.svg``, the stale mismatch at each update index of a generation batch.

Top: the reward and the rollout-vs-training flip rate against the optimizer step, per arm: at each step the mean
over the arm's cells (bases x seeds) of each cell's running mean over ``WINDOW`` logged values, with a 95% t
interval over those cells. Bottom: one point per cell, the routing's top-k overlap with the ``sft`` start on the
probe set against the cell's final reward (the mean of its last tenth of logged rewards). Same cells, same bytes
(``figures.save``).
"""

from __future__ import annotations

import statistics
from pathlib import Path

import numpy as np
from scipy.stats import t as student_t

from rpb.toyworld.study.figures import _figure, _style, _unique, save

RL_FIGURE = "rl.svg"
STALE_FIGURE = "stale.svg"
#: logged values in each cell's running mean (the reward is logged once per generation batch)
WINDOW = 10
CURVES = (("reward", "reward (exact match)"), ("rollout_flip_rate", "flip rate (rollout vs training top-k)"))


def logged(values: list[float | None]) -> tuple[list[int], list[float]]:
    """The steps (from 1) that logged a value, and the values."""
    kept = [(i + 1, v) for i, v in enumerate(values) if v is not None]
    return [s for s, _ in kept], [v for _, v in kept]


def running_mean(values: list[float], window: int = WINDOW) -> list[float]:
    """The mean of the last ``window`` values at each position (fewer at the start)."""
    return [statistics.fmean(values[max(0, i + 1 - window) : i + 1]) for i in range(len(values))]


def final_reward(cell: dict) -> float:
    """The mean of the last tenth (at least one) of a cell's logged rewards."""
    _, values = logged(cell["rl"]["reward"])
    return statistics.fmean(values[-max(1, len(values) // 10) :])


def band(curves: list[list[float]]) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Mean and 95% t interval over cells at each position (the curves cut to the shortest); the interval is the
    mean itself where there is one cell."""
    n = min(len(c) for c in curves)
    stack = np.array([c[:n] for c in curves], dtype=float)
    mean = stack.mean(axis=0)
    if len(curves) < 2:
        return mean, mean, mean
    half = student_t.ppf(0.975, len(curves) - 1) * stack.std(axis=0, ddof=1) / np.sqrt(len(curves))
    return mean, mean - half, mean + half


def rl_figure(results: list[dict], title: str):
    """The figure (module docstring) over the cells ``results``, arms in their order of appearance."""
    arms = _unique(r["arm"] for r in results)
    with _style():
        fig = _figure(11.0, 8.0)
        top = fig.subfigures(2, 1, height_ratios=(1.0, 1.1))
        curve_axes = top[0].subplots(1, len(CURVES))
        colours = {a: f"C{i}" for i, a in enumerate(arms)}
        for ax, (key, label) in zip(curve_axes, CURVES, strict=True):
            for arm in arms:
                cells = [r for r in results if r["arm"] == arm]
                traced = [logged(r["rl"][key]) for r in cells]
                if not traced or not all(values for _, values in traced):
                    continue
                steps = min(traced, key=lambda t: len(t[0]))[0]
                mean, lo, hi = band([running_mean(values) for _, values in traced])
                ax.fill_between(steps, lo, hi, color=colours[arm], alpha=0.15, lw=0, gid=f"{key}-{arm}-band")
                ax.plot(steps, mean, color=colours[arm], lw=1.2, label=arm, gid=f"{key}-{arm}-mean")
            ax.set_xlabel("optimizer step")
            ax.set_ylabel(label)
            ax.grid(color="0.9", lw=0.6)
        handles, labels = curve_axes[0].get_legend_handles_labels()
        top[0].legend(handles, labels, loc="outside right center", frameon=False, fontsize=8)
        top[0].suptitle(
            f"{title}: per arm, the mean over its cells of each cell's running mean over {WINDOW} logged values, "
            "with a 95% t interval over the cells"
        )
        ax = top[1].subplots()
        for arm in arms:
            cells = [r for r in results if r["arm"] == arm and "retention" in r]
            xs = [final_reward(r) for r in cells]
            ys = [r["retention"]["start_topk_overlap"] for r in cells]
            ax.plot(xs, ys, ls="none", marker="o", ms=4, color=colours[arm], label=arm, gid=f"cells-{arm}")
        ax.set_xlabel("final reward (mean of the last tenth of the logged rewards)")
        ax.set_ylabel("top-k overlap with the sft start\n(probe set)")
        ax.grid(color="0.9", lw=0.6)
        top[1].suptitle(
            "each cell (colours as above): how much of its start's routing it kept, against the reward it reached"
        )
    return fig


def write_rl_figure(out: Path, title: str, results: list[dict]) -> Path:
    return save(rl_figure(results, title), Path(out) / RL_FIGURE)


def has_stale_by_update(results: list[dict]) -> bool:
    """Whether the cells record the stale mismatch per update index (cells from before issue 64 do not)."""
    return any(r.get("rl", {}).get("stale_mismatch_by_update") for r in results)


def stale_figure(results: list[dict], title: str):
    """Per arm, at each update index i >= 1 of a generation batch: the mean over the arm's cells of each cell's mean
    ``routing/stale_mismatch/update_<i>`` over training, with a 95% t interval over those cells; one point per
    cell beside it."""
    arms = _unique(r["arm"] for r in results)
    with _style():
        fig = _figure(8.0, 4.5)
        ax = fig.subplots()
        for k, arm in enumerate(arms):
            by_cell = [r["rl"].get("stale_mismatch_by_update") or {} for r in results if r["arm"] == arm]
            updates = sorted({int(i) for cell in by_cell for i in cell})
            if not updates:
                continue
            curves = [[cell.get(str(i), np.nan) for i in updates] for cell in by_cell]
            mean, lo, hi = band(curves)
            x = np.array(updates) + (k - (len(arms) - 1) / 2) * 0.06  # arms side by side at each index
            ax.errorbar(x, mean, yerr=[mean - lo, hi - mean], color=f"C{k}", ls="none", capsize=2, lw=1.0)
            ax.plot(x, mean, color=f"C{k}", marker="o", ms=4, lw=1.2, label=arm, gid=f"stale-{arm}")
            for curve in curves:
                ax.plot(x, curve, ls="none", marker=".", ms=2, color=f"C{k}", alpha=0.4)
        ax.set_xlabel("update index within a generation batch (0: the policy that generated it)")
        ax.set_ylabel("stale mismatch\n(live top-k vs the replayed routes)")
        ax.grid(color="0.9", lw=0.6)
        ax.legend(loc="upper left", frameon=False, fontsize=8)
        fig.suptitle(f"{title}: the stale mismatch per update index, mean over cells with a 95% t interval")
    return fig


def write_stale_figure(out: Path, title: str, results: list[dict]) -> Path:
    return save(stale_figure(results, title), Path(out) / STALE_FIGURE)
