"""The ``hold-target`` grid's report across its bases (``rpb.toyworld.grids.hold_target``): tables.md,
results.json, bases.json, and its figures:

* ``overlap.svg``: each cell's OOD and ID exact match against its ``mechanism.overlap_base`` (the overlap with the
  base's own top-k on training rows, the measure a target holds), the fixed-λ cells beside the target ones;
* ``tradeoff.svg``: OOD against ID per cell, for every arm of this grid and of the ``hold`` grid (read from its
  shipped results): an arm that learns less in domain keeps more out of domain, so an arm is better only if it keeps
  more OOD at the same ID;
* ``lambda.svg``: base 0's target-0.80 cells under softmax and under the normalised sigmoid, λ per logging window;
* ``forest.svg`` and ``claims.svg`` as every grid's.

Beside the claims (judged by rule, Holm across them), outside Holm: (1) the acceptance check, every target cell
listed (the mean m over the last ``ACCEPT_TAIL`` of its steps within ``ACCEPT_BAND`` of its target; cells whose λ
reached λ_max named); (5) the sigmoid control per seed; and each arm's OOD at the ``sft`` cells' mean ID
(``adjusted_ood``: one least-squares fit per set across the grid's cells, a common slope of OOD on ID and one
intercept per arm, its interval from the two-stage bootstrap over bases and then seeds, the fit redone per resample).
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np

from rpb.anchors.target import TargetSettings
from rpb.toyworld.grids.hold_report import differences, scores_table
from rpb.toyworld.study.claims import verdict_table
from rpb.toyworld.study.figures import _figure, _style, _unique, save, write_figures
from rpb.toyworld.study.report import write_across
from rpb.toyworld.study.stats import BOOTSTRAP_SEED, RESAMPLES, interval
from rpb.toyworld.study.tables import bases_table, machine_mix, mean_sd

OVERLAP_FIGURE, TRADEOFF_FIGURE, LAMBDA_FIGURE = "overlap.svg", "tradeoff.svg", "lambda.svg"
#: where the hold grid's shipped cells are, for the trade-off figure
HOLD_RESULTS = Path(__file__).resolve().parents[4] / "docs" / "results" / "hold" / "results.json"
#: λ's ceiling: a cell whose λ reached it could not hold its target with the term alone
LAMBDA_MAX = TargetSettings(target=1.0).lambda_max


def sigmoid_cells(studies: list) -> list[dict]:
    """Base 0's control cells (``sigmoid/<set>/seed<k>/result.json``), in order."""
    return [json.loads(p.read_text()) for st in studies for p in sorted(Path(st.out).glob("sigmoid/*/*/result.json"))]


def tail_overlap(r: dict, tail: float) -> float | None:
    """The mean m of the cell's logging windows over the last ``tail`` of its steps (None: it logged none)."""
    hold = r.get("hold") or {}
    steps, m = hold.get("step") or [], hold.get("overlap") or []
    if not m:
        return None
    start = hold.get("max_steps", max(steps)) * (1 - tail)
    kept = [v for s, v in zip(steps, m, strict=True) if s > start]
    return float(np.mean(kept)) if kept else None


def acceptance_table(cells: list[dict], band: float, tail: float) -> str:
    """(1): every cell that held a target, its last steps' mean m against the target, λ at the end and its highest."""
    rows, inside = [], 0
    for r in sorted(cells, key=lambda r: (r["set"], r["arm"], r.get("base", 0), r["seed"])):
        target = (r.get("anchor") or {}).get("target")
        if target is None:
            continue
        m = tail_overlap(r, tail)
        lams = [v for v in (r.get("hold") or {}).get("lambda") or [] if v is not None]
        ok = m is not None and abs(m - target) <= band
        inside += ok
        at_max = bool(lams) and max(lams) >= LAMBDA_MAX
        rows.append(
            f"| {r['set']} | {r['arm']} | {r.get('base', 0)} | {r['seed']} | {target:.3f} | "
            f"{'n/a' if m is None else f'{m:.3f}'} | {'yes' if ok else '**no**'} | "
            f"{lams[-1] if lams else float('nan'):.3g} | {max(lams) if lams else float('nan'):.3g}"
            f"{' **at λ_max**' if at_max else ''} |"
        )
    head = [
        f"### (1) Acceptance: each target cell's mean overlap over its last {tail:.0%} of steps, within ±{band:g} "
        "of its target (outside Holm)",
        "",
        f"{inside} of {len(rows)} cells inside the band.",
        "",
        "| set | arm | base | seed | target | m, last steps | inside | λ at the end | λ highest |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    return "\n".join(head + rows) + "\n"


def overlap_table(results: list[dict], post_set: str, arms: tuple[str, ...], tail: float) -> str:
    """Per arm: the overlap a target holds (``mechanism.overlap_base``, training rows after training) and the last
    steps' m during training, beside the target asked for."""
    lines = [
        f"### {post_set}: the routing each arm kept (mean ± sd over cells)",
        "",
        "| arm | cells | target | m, last steps (training) | overlap with the base's top-k, training rows |",
        "|---|---|---|---|---|",
    ]
    for arm in arms:
        cells = [r for r in results if r["set"] == post_set and r["arm"] == arm]
        if not cells:
            continue
        targets = [t for r in cells if (t := (r.get("anchor") or {}).get("target")) is not None]
        tails = [m for r in cells if (m := tail_overlap(r, tail)) is not None]
        kept = [r["mechanism"]["overlap_base"] for r in cells if "mechanism" in r]
        lines.append(
            f"| {arm} | {len(cells)} | {mean_sd(targets, 3, '—')} | {mean_sd(tails, 3, '—')} | {mean_sd(kept, 3)} |"
        )
    return "\n".join(lines) + "\n"


def _fit(ids: np.ndarray, oods: np.ndarray, arm_index: np.ndarray, arms: int, at: float) -> np.ndarray | None:
    """Least squares OOD = a_arm + b * ID; each arm's fitted OOD at ID ``at`` (None: a degenerate design)."""
    design = np.zeros((len(ids), arms + 1))
    design[np.arange(len(ids)), arm_index] = 1.0
    design[:, -1] = ids
    if np.linalg.matrix_rank(design) < arms + 1:
        return None
    coef = np.linalg.lstsq(design, oods, rcond=None)[0]
    return coef[:arms] + coef[-1] * at


def adjusted_ood(
    results: list[dict], post_set: str, arms: tuple[str, ...], resamples: int = RESAMPLES, seed: int = BOOTSTRAP_SEED
) -> dict:
    """Each arm's OOD (points) at the ``sft`` cells' mean ID, from one fit across the set's cells (module doc), with
    its 95% interval: the bases resampled, then the seeds within each (every arm's cell of a drawn (base, seed) goes
    with it), the fit and the ``sft`` mean ID redone each time; ``_resamples``, the resamples whose design was whole."""
    cells = [r for r in results if r["set"] == post_set and r["arm"] in arms]
    present = tuple(a for a in arms if any(r["arm"] == a for r in cells))
    if "sft" not in present or len(cells) < len(present) + 2:
        return {}
    index = {a: i for i, a in enumerate(present)}

    def estimate(chosen: list[dict]):
        ids = np.array([100 * r["id"] for r in chosen])
        oods = np.array([100 * r["ood"] for r in chosen])
        where = np.array([index[r["arm"]] for r in chosen])
        if not all((where == i).any() for i in range(len(present))):
            return None
        return _fit(ids, oods, where, len(present), float(ids[where == index["sft"]].mean()))

    point = estimate(cells)
    if point is None:
        return {}
    by_base: dict[int, dict[int, list[dict]]] = {}
    for r in cells:
        by_base.setdefault(r.get("base", 0), {}).setdefault(r["seed"], []).append(r)
    bases = sorted(by_base)
    rng = np.random.default_rng(seed)
    draws = []
    for _ in range(resamples):
        chosen = []
        for b in rng.integers(len(bases), size=len(bases)):
            seeds = sorted(by_base[bases[b]])
            for s in rng.integers(len(seeds), size=len(seeds)):
                chosen += by_base[bases[b]][seeds[s]]
        if (e := estimate(chosen)) is not None:
            draws.append(e)
    boot = np.array(draws)
    return {
        arm: {"ood": float(point[i]), "ci": interval(boot[:, i]) if len(boot) else (np.nan, np.nan)}
        for arm, i in index.items()
    } | {"_resamples": len(boot)}


def adjusted_table(results: list[dict], sets: tuple[str, ...], arms: tuple[str, ...]) -> str:
    lines = [
        "### Each arm's OOD at the `sft` cells' mean ID (outside Holm)",
        "",
        "One fit per set across the grid's cells: a common slope of OOD on ID and one intercept per arm; the interval "
        "from the two-stage bootstrap (bases, then seeds), the fit redone on each resample.",
        "",
        "| set | arm | OOD at sft's mean ID (%) | 95% CI |",
        "|---|---|---|---|",
    ]
    for s in sets:
        fit = adjusted_ood(results, s, arms)
        for arm in arms:
            if arm in fit:
                lo, hi = fit[arm]["ci"]
                lines.append(f"| {s} | {arm} | {fit[arm]['ood']:.1f} | [{lo:.1f}, {hi:.1f}] |")
    return "\n".join(lines) + "\n"


def sigmoid_table(results: list[dict], controls: list[dict], tail: float) -> str:
    """(5): base 0, target 0.80, softmax (the grid's cells) against the normalised sigmoid (the control), per seed."""
    lines = [
        "### (5) Base 0, target 0.80: softmax against the normalised sigmoid (outside Holm)",
        "",
        "| set | seed | transform | top-k overlap (probe) | OOD | ID | m, last steps | λ at the end |",
        "|---|---|---|---|---|---|---|---|",
    ]
    soft = [r for r in results if r["arm"] == "target 0.80" and r.get("base", 0) == 0]
    for r in sorted(soft + controls, key=lambda r: (r["set"], r["seed"], r["arm"])):
        lams = [v for v in (r.get("hold") or {}).get("lambda") or [] if v is not None]
        m = tail_overlap(r, tail)
        lines.append(
            f"| {r['set']} | {r['seed']} | {'sigmoid' if r['arm'] != 'target 0.80' else 'softmax'} | "
            f"{r['retention']['topk_overlap']:.3f} | {100 * r['ood']:.1f} | {100 * r['id']:.1f} | "
            f"{'n/a' if m is None else f'{m:.3f}'} | {lams[-1] if lams else float('nan'):.3g} |"
        )
    return "\n".join(lines) + "\n"


def overlap_figure(results: list[dict], sets: tuple[str, ...], arms: tuple[str, ...]):
    """OOD (top row) and ID (bottom row) against ``mechanism.overlap_base`` for every cell, per set."""
    with _style():
        fig = _figure(3.2 + 4.0 * len(sets), 7.0)
        axes = fig.subplots(2, len(sets), sharex=True, squeeze=False)
        colours = {a: f"C{i}" for i, a in enumerate(_unique(arms))}
        for col, s in enumerate(sets):
            for row, metric in enumerate(("ood", "id")):
                ax = axes[row][col]
                for arm in arms:
                    cells = [r for r in results if r["set"] == s and r["arm"] == arm and "mechanism" in r]
                    x = [r["mechanism"]["overlap_base"] for r in cells]
                    y = [100 * r[metric] for r in cells]
                    marker = "s" if arm == "routing-kd" else "o"
                    gid = f"{s}-{metric}-{arm}"
                    ax.plot(x, y, ls="none", marker=marker, ms=4, color=colours[arm], label=arm, gid=gid)
                ax.set_title(f"{s}, {metric.upper()}")
                ax.grid(color="0.9", lw=0.6)
                if row == 1:
                    ax.set_xlabel("overlap with the base's top-k, training rows")
            axes[0][0].set_ylabel("out-of-domain exact match (%)")
            axes[1][0].set_ylabel("in-domain exact match (%)")
        handles, labels = axes[0][0].get_legend_handles_labels()
        fig.legend(handles, labels, loc="outside right center", frameon=False)
        fig.suptitle("Grid `hold-target`: what each cell kept of the routing, and of what the base knew")
    return fig


def tradeoff_figure(results: list[dict], hold: list[dict], sets: tuple[str, ...]):
    """OOD against ID per cell: this grid's arms (filled) and the ``hold`` grid's (open)."""
    with _style():
        fig = _figure(3.2 + 4.0 * len(sets), 4.6)
        axes = fig.subplots(1, len(sets), squeeze=False)[0]
        groups = [("hold-target", results, True), ("hold", hold, False)]
        names = _unique([f"{g}: {r['arm']}" for g, rs, _ in groups for r in rs])
        colours = {n: f"C{i % 10}" for i, n in enumerate(names)}
        for ax, s in zip(axes, sets, strict=True):
            for grid, cells, filled in groups:
                for arm in _unique([r["arm"] for r in cells]):
                    mine = [r for r in cells if r["set"] == s and r["arm"] == arm]
                    name = f"{grid}: {arm}"
                    face = colours[name] if filled else "none"
                    xy = ([100 * r["id"] for r in mine], [100 * r["ood"] for r in mine])
                    style = dict(ls="none", marker="o", ms=4, mfc=face, mec=colours[name])
                    ax.plot(*xy, **style, label=name, gid=f"{s}-{name}")
            ax.set_title(s)
            ax.set_xlabel("in-domain exact match (%)")
            ax.grid(color="0.9", lw=0.6)
        axes[0].set_ylabel("out-of-domain exact match (%)")
        handles, labels = axes[0].get_legend_handles_labels()
        fig.legend(handles, labels, loc="outside right center", frameon=False, fontsize=7)
        fig.suptitle("OOD against ID per cell: `hold-target` (filled) and `hold` (open)")
    return fig


def lambda_figure(results: list[dict], controls: list[dict], sets: tuple[str, ...]):
    """Base 0, target 0.80: λ per logging window, softmax (solid) and the normalised sigmoid (dashed), per seed."""
    soft = [r for r in results if r["arm"] == "target 0.80" and r.get("base", 0) == 0]
    with _style():
        fig = _figure(3.2 + 4.0 * len(sets), 4.0)
        axes = fig.subplots(1, len(sets), sharey=True, squeeze=False)[0]
        for ax, s in zip(axes, sets, strict=True):
            for cells, style, name in ((soft, "-", "softmax"), (controls, "--", "sigmoid")):
                for i, r in enumerate(c for c in cells if c["set"] == s):
                    hold = r.get("hold") or {}
                    label, gid = f"{name}, seed {r['seed']}", f"{s}-{name}-{r['seed']}"
                    ax.plot(hold.get("step", []), hold.get("lambda", []), ls=style, color=f"C{i}", label=label, gid=gid)
            ax.set_yscale("log")
            ax.set_title(s)
            ax.set_xlabel("step")
            ax.grid(color="0.9", lw=0.6)
        axes[0].set_ylabel("λ")
        handles, labels = axes[0].get_legend_handles_labels()
        fig.legend(handles, labels, loc="outside right center", frameon=False)
        fig.suptitle("Base 0, target 0.80: λ under softmax and under the normalised sigmoid")
    return fig


def write_hold_target_report(grid, studies: list, results: list[dict], out: Path, judge, band: float, tail: float):
    """tables.md and the figures across the bases; returns the tables."""
    arms = tuple(a.label for a in grid.arms)
    controls = sigmoid_cells(studies)
    verdicts = judge(results, grid.sets)
    hold = json.loads(HOLD_RESULTS.read_text()) if HOLD_RESULTS.is_file() else []
    parts = [
        f"# Toy-world study: grid `{grid.name}` on bases {[st.base_seed for st in studies]}",
        "",
        bases_table(studies),
        machine_mix(results + controls),
        "",
        *(scores_table(results, s, arms) for s in grid.sets),
        *(overlap_table(results, s, arms, tail) for s in grid.sets),
        "### The claims, fixed before the first cell (rpb/toyworld/grids/hold_target.py), judged by rule",
        "",
        verdict_table(verdicts, "claim (the grid's)"),
        acceptance_table(results + controls, band, tail),
        sigmoid_table(results, controls, tail),
        adjusted_table(results, grid.sets, arms),
        "Cost per step of a target against a fixed λ: docs/performance.md (`benchmarks/target_overhead.py`); of "
        "`routing-kd` itself: `benchmarks/teacher_overhead.py`.",
        "",
        f"![OOD and ID against the overlap kept]({OVERLAP_FIGURE})",
        "",
        f"![OOD against ID, this grid and hold]({TRADEOFF_FIGURE})",
        "",
        f"![λ, softmax and sigmoid]({LAMBDA_FIGURE})",
        "",
    ]
    tables = "\n".join(parts)
    write_across(out, tables, results, studies)
    write_figures(out, f"Grid `{grid.name}`", differences(results, grid.sets, arms), verdicts)
    save(overlap_figure(results, grid.sets, arms), Path(out) / OVERLAP_FIGURE)
    save(tradeoff_figure(results, hold, grid.sets), Path(out) / TRADEOFF_FIGURE)
    save(lambda_figure(results, controls, grid.sets), Path(out) / LAMBDA_FIGURE)
    return tables
