"""The ``hold`` grid's report across its bases (``rpb.toyworld.grids.hold``): tables.md, results.json, bases.json,
hold.svg (each cell's top-k overlap with the base against its out-of-domain exact match, the arms' means with
their intervals), forest.svg (each arm minus ``sft``, ID and OOD) and claims.svg (the claims, judged).

The revert figures come from the cells that carry them: the ``routing-kd`` cells, and the ``sft`` cells trained
again for it (``revert/``; the grid's own ``sft`` cells are the ``full`` grid's, without a checkpoint). Those
retrained cells' exact match is set beside the copied cells': the same training, so the same figures on the
machine type that ran both. The claims are judged again with the retrained cells in place of the copied ones
(``against_retrained``): the copied cells may have run on another CPU than the grid's new arms, whose bits differ;
the retrained ones ran beside them. A check printed under the grid's verdicts, never in their place."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np

from rpb.toyworld.study.claims import verdict_table
from rpb.toyworld.study.figures import Difference, _figure, _style, _unique, save, write_figures
from rpb.toyworld.study.report import write_across
from rpb.toyworld.study.stats import interval, paired_differences, two_stage_bootstrap
from rpb.toyworld.study.tables import bases_table, machine_mix, mean_sd, weights_table
from rpb.toyworld.world.generators import DOMAINS

HOLD_FIGURE = "hold.svg"
REVERTED_VARIANT = "post+base routers"  # rpb.retention.revert's name of the model with the base's routers


def revert_cells(studies: list) -> list[dict]:
    """The retrained ``sft`` cells of every base (``revert/<set>/sft/seed<k>/result.json``), in order."""
    return [json.loads(p.read_text()) for st in studies for p in sorted(Path(st.out).glob("revert/*/*/*/result.json"))]


def _figure_of(r: dict, key: str) -> float:
    if key in ("id", "ood"):
        return float(100.0 * r[key])
    return float(r.get("retention", {}).get(key, np.nan))


def scores_table(results: list[dict], post_set: str, arms: tuple[str, ...]) -> str:
    lines = [
        f"### {post_set}: exact match (test part, %) and retention on the probe set (mean ± sd over cells)",
        "",
        "| arm | cells | ID | OOD | top-k overlap | TVD | NMI |",
        "|---|---|---|---|---|---|---|",
    ]
    for arm in arms:
        cells = [r for r in results if r["set"] == post_set and r["arm"] == arm]
        shown = (("id", 1), ("ood", 1), ("topk_overlap", 3), ("tvd", 3), ("nmi", 3))
        figures = [mean_sd([v for r in cells if not np.isnan(v := _figure_of(r, k))], d) for k, d in shown]
        lines.append(f"| {arm} | {len(cells)} | " + " | ".join(figures) + " |")
    return "\n".join(lines) + "\n"


def revert_table(cells: list[dict], post_set: str) -> str:
    """Per arm: the change in answer NLL from putting the base's routers back, on the trained set and on the mean
    of the pretraining domains, and the top-k overlap with the base before and after."""
    lines = [
        f"### {post_set}: the base's routers put back (`rpb retention --revert-routers`; mean ± sd over cells)",
        "",
        "| arm | cells | Δ NLL, trained set | Δ NLL, pretraining domains | overlap, post | overlap, reverted |",
        "|---|---|---|---|---|---|",
    ]
    for arm in ("sft", "routing-kd"):
        rs = [r["revert"] for r in cells if r["set"] == post_set and r["arm"] == arm and "revert" in r]
        if not rs:
            continue
        trained = [v[post_set]["delta_nll"] for v in rs]
        domains = [float(np.mean([v[d]["delta_nll"] for d in DOMAINS])) for v in rs]
        post = [float(np.mean([v[d]["variants"]["post"]["topk_overlap"] for d in v])) for v in rs]
        back = [float(np.mean([v[d]["variants"][REVERTED_VARIANT]["topk_overlap"] for d in v])) for v in rs]
        lines.append(
            f"| {arm} | {len(rs)} | {mean_sd(trained, 4)} | {mean_sd(domains, 4)} | {mean_sd(post, 3)} | "
            f"{mean_sd(back, 3)} |"
        )
    return "\n".join(lines) + "\n"


def _revert_sources(results: list[dict], retrained: list[dict], post_set: str) -> list[dict]:
    """The cells the revert table reads on ``post_set``: the retrained ``sft`` cells where there are any (the grid's
    own are then the ``full`` grid's copies, which carry no revert), with the ``routing-kd`` cells."""
    mine = [r for r in retrained if r["set"] == post_set]
    return [r for r in results if r["set"] == post_set and not (mine and r["arm"] == "sft")] + mine


def retrained_against_copied(results: list[dict], retrained: list[dict]) -> str:
    """The retrained ``sft`` cells' exact match against the copied cells of the same base, set and seed."""
    copied = {(r.get("base", 0), r["set"], r["seed"]): r for r in results if r["arm"] == "sft"}
    gaps = [
        abs(100 * (r[m] - copied[key][m]))
        for r in retrained
        if (key := (r.get("base", 0), r["set"], r["seed"])) in copied
        for m in ("id", "ood")
    ]
    if not gaps:
        return "No retrained `sft` cell has its copied cell here.\n"
    same = sum(g == 0 for g in gaps)
    return (
        f"The {len(gaps) // 2} retrained `sft` cells against the copied ones: {same} of {len(gaps)} exact-match "
        f"figures equal, the largest gap {max(gaps):.1f} points.\n"
    )


def against_retrained(results: list[dict], retrained: list[dict], judge, sets: tuple[str, ...]) -> str:
    """The claims judged again on ``results`` with each copied ``sft`` cell that has a retrained twin (same base,
    set and seed) replaced by it; empty when none has one."""
    twin = {(r.get("base", 0), r["set"], r["seed"]): r for r in retrained}
    swapped, replaced, copied = [], 0, 0
    for r in results:
        key = (r.get("base", 0), r["set"], r["seed"])
        if r["arm"] == "sft":
            copied += 1
            if key in twin:
                replaced += 1
                r = twin[key] | {"arm": "sft"}
        swapped.append(r)
    if not replaced:
        return ""
    return "\n".join(
        [
            "### The claims again, with the `sft` cells retrained beside the new arms in place of the copied ones",
            "",
            f"{replaced} of {copied} `sft` cells replaced (the rest copied); a check on the machine mix, not the "
            "grid's verdict, which is the table above.",
            "",
            verdict_table(judge(swapped, sets), "claim (the grid's), against the retrained `sft` cells"),
        ]
    )


def differences(results: list[dict], sets: tuple[str, ...], arms: tuple[str, ...]) -> list[Difference]:
    out = []
    for s in sets:
        for arm in arms:
            if arm == "sft":
                continue
            for metric in ("id", "ood"):
                d = paired_differences(results, s, arm, "sft", metric)
                if d:
                    lo, hi = interval(two_stage_bootstrap(d))
                    out.append(Difference(s, arm, metric, "sft", d, lo, hi))
    return out


def _by_base(cells: list[dict], key: str) -> dict[int, list[float]]:
    bases = sorted({r.get("base", 0) for r in cells})
    return {b: [_figure_of(r, key) for r in cells if r.get("base", 0) == b] for b in bases}


def hold_figure(
    results: list[dict],
    sets: tuple[str, ...],
    arms: tuple[str, ...],
    title: str = "Grid `hold`: keeping the routing against keeping what the base knew",
):
    """Per set, each cell's top-k overlap with the base (x) against its OOD exact match (y), and each arm's mean
    with the 95% interval of its mean across bases and seeds (the two-stage bootstrap) on both axes."""
    with _style():
        fig = _figure(3.2 + 4.2 * len(sets), 4.6)  # the legend takes the right-hand side
        axes = fig.subplots(1, len(sets), sharey=True, squeeze=False)[0]
        colours = {a: f"C{i}" for i, a in enumerate(_unique(arms))}
        for ax, s in zip(axes, sets, strict=True):
            for arm in arms:
                cells = [r for r in results if r["set"] == s and r["arm"] == arm]
                if not cells:
                    continue
                x = [_figure_of(r, "topk_overlap") for r in cells]
                y = [_figure_of(r, "ood") for r in cells]
                ax.plot(x, y, ls="none", marker="o", ms=3, alpha=0.45, color=colours[arm], gid=f"{s}-{arm}-cells")
                (xlo, xhi), (ylo, yhi) = (
                    interval(two_stage_bootstrap(_by_base(cells, k))) for k in ("topk_overlap", "ood")
                )
                mx, my = float(np.mean(x)), float(np.mean(y))
                bars = {"xerr": [[mx - xlo], [xhi - mx]], "yerr": [[my - ylo], [yhi - my]]}
                ax.errorbar(
                    mx, my, **bars, marker="s", ms=6, color=colours[arm], capsize=2, label=arm, gid=f"{s}-{arm}-mean"
                )
            ax.set_title(s)
            ax.set_xlabel("top-k overlap with the base (probe set)")
            ax.grid(color="0.9", lw=0.6)
        axes[0].set_ylabel("out-of-domain exact match (%)")
        handles, labels = axes[0].get_legend_handles_labels()
        fig.legend(handles, labels, loc="outside right center", frameon=False)
        fig.suptitle(f"{title}\neach cell, and each arm's mean with its 95% interval (bases, then seeds)")
    return fig


def write_hold_report(grid, studies: list, results: list[dict], out: Path, judge) -> str:
    """tables.md and the figures across the bases; returns the tables. ``judge``: the grid's claims."""
    arms = tuple(a.label for a in grid.arms)
    retrained = revert_cells(studies)
    verdicts = judge(results, grid.sets)
    parts = [
        f"# Toy-world study: grid `{grid.name}` on bases {[st.base_seed for st in studies]}",
        "",
        bases_table(studies),
        machine_mix(results + retrained),
        "",
        *(scores_table(results, s, arms) for s in grid.sets),
        weights_table(grid, studies),
        "### The claims, fixed before the first cell (rpb/toyworld/grids/hold.py), judged by rule",
        "",
        verdict_table(verdicts, "claim (the grid's)"),
        *(revert_table(_revert_sources(results, retrained, s), s) for s in grid.sets),
        retrained_against_copied(results, retrained),
        against_retrained(results, retrained, judge, grid.sets),
        "What `routing-kd` costs per step (online under LoRA, from a frozen copy, from stored routes): "
        "docs/performance.md (`benchmarks/teacher_overhead.py`); what its λ multiplies per transform and source: "
        "docs/methods.md (`benchmarks/term_scale.py`).",
        "",
        f"![overlap against OOD]({HOLD_FIGURE})",
        "",
    ]
    tables = "\n".join(parts)
    write_across(out, tables, results, studies)
    found = differences(results, grid.sets, arms)
    write_figures(out, f"Grid `{grid.name}`", found, verdicts)
    save(hold_figure(results, grid.sets, arms), Path(out) / HOLD_FIGURE)
    return tables
