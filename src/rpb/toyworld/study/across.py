"""A grid on several bases: one ``Study`` per base (``base<seed>/``), then the report across them.

The tables pair every method with ``sft`` (in a grid over beta without it, with its beta-0 arm, ``sft`` bit
for bit) on the same (base, seed) and give the mean difference with
a 95% interval from the two-stage bootstrap (bases, then seeds within them), each base's own mean
difference beside it, and under each table the minimal detectable difference of those pairs. Then
the mechanism (what the bias did to the routing), each base's calibrated beta, the paper's claims
with computed verdicts (``Grid.claims``), and -- where the grid judges the beta rule -- its regret. Beside the
tables, the same differences and verdicts as figures (rpb.toyworld.study.figures): ``forest.svg`` and ``claims.svg``.
"""

from __future__ import annotations

import json
import statistics
from pathlib import Path

from rpb.anchors import AnchorConfig
from rpb.errors import RpbError
from rpb.toyworld.study.cells import Study, cell_paths
from rpb.toyworld.study.claims import judge, verdict_table
from rpb.toyworld.study.figures import Difference, write_figures
from rpb.toyworld.study.grid import Grid
from rpb.toyworld.study.report import write_across
from rpb.toyworld.study.stats import (
    interval,
    minimal_detectable_difference,
    paired_differences,
    points,
    two_stage_bootstrap,
)
from rpb.toyworld.study.tables import bases_table, machine_mix, mean_sd, mechanism_table, weights_table
from rpb.toyworld.world.post import PostRecipe

REFERENCE = "sft"
#: a first estimate of one cell's minutes on 2 CPU cores with the grids' recipe (train, score both parts,
#: retention, mechanism), replaced by the mean of finished cells once there are some
FIRST_ESTIMATE_MINUTES = 2.5


def reference_arm(results: list[dict], arms: tuple[str, ...]) -> str:
    """The arm every method is paired with: ``sft``, or in a grid without it its rpb arm at beta 0,
    which trains as ``sft`` does bit for bit (tests/train/test_run.py)."""
    if REFERENCE in arms:
        return REFERENCE
    zero = [a for a in arms if any(r["arm"] == a and r["method"] == "rpb" and _beta_of(r) == 0.0 for r in results)]
    return zero[0] if zero else REFERENCE


def differences(results: list[dict], post_set: str, arms: tuple[str, ...]) -> list[Difference]:
    """Each method (in ``arms``' order) minus the reference arm on ``post_set``, ID then OOD: the paired
    differences and the 95% interval of their mean from the two-stage bootstrap (bases, then seeds)."""
    ref = reference_arm(results, arms)
    ran = {r["arm"] for r in results if r["set"] == post_set}
    found = []
    for arm in arms:
        if arm == ref or arm not in ran:
            continue
        for metric in ("id", "ood"):
            d = paired_differences(results, post_set, arm, ref, metric)
            if d:
                found.append(Difference(post_set, arm, metric, ref, d, *interval(two_stage_bootstrap(d))))
    return found


def _difference(found: dict[tuple[str, str], Difference], arm: str, metric: str) -> tuple[str, str, list[float]]:
    d = found.get((arm, metric))
    if d is None:
        return "—", "—", []
    per_base = " / ".join(f"b{b} {statistics.fmean(v):+.1f}" for b, v in sorted(d.per_base.items()))
    return f"{d.mean:+.1f} [{d.lo:+.1f}, {d.hi:+.1f}]", per_base, d.values


def scores_table(
    results: list[dict], post_set: str, arms: tuple[str, ...], found: list[Difference] | None = None
) -> str:
    """``found``: ``differences(results, post_set, arms)``, when the caller has them already."""
    rows = [r for r in results if r["set"] == post_set]
    ref = reference_arm(results, arms)
    by = {(d.arm, d.metric): d for d in (differences(results, post_set, arms) if found is None else found)}
    named = ref if ref == REFERENCE else f"{ref} (sft bit for bit)"
    header = ["method"] + [
        f"{m} %" if k == 0 else f"Δ {m} vs {ref} [95% CI]" if k == 1 else f"Δ {m} per base"
        for m in ("ID", "OOD")
        for k in range(3)
    ]
    lines = [
        f"### {post_set}: exact match, and each method minus {named} on the same base and seed",
        "",
        "| " + " | ".join(header) + " |",
        "|---" * len(header) + "|",
    ]
    mdd = []
    for arm in arms:
        cells = [r for r in rows if r["arm"] == arm]
        if not cells:
            continue
        row = [arm]
        for metric in ("id", "ood"):
            estimate, per_base, flat = _difference(by, arm, metric) if arm != ref else ("", "", [])
            row += [mean_sd([points(r, metric) for r in cells]), estimate, per_base]
            if len(flat) > 1:
                sd = statistics.stdev(flat)
                mdd.append(f"{arm} {metric.upper()} {minimal_detectable_difference(sd, len(flat)):.1f} (sd {sd:.1f})")
        lines.append("| " + " | ".join(row) + " |")
    pairs = len([r for r in rows if r["arm"] == ref])
    legend = (
        f"Minimal detectable difference against {ref} (α 0.05 two-sided, power 0.8, t with pairs − 1 degrees "
        f"of freedom on the paired SD; {pairs} pairs), points: "
    )
    lines += ["", legend + ("; ".join(mdd) or "n/a"), ""]
    return "\n".join(lines)


def _beta_of(result: dict) -> float | None:
    """The beta a cell trained with: ``rpb`` cells carry it in their anchor (the default when not set), and
    ``sft`` is ``rpb`` at beta 0 bit for bit; other methods have none."""
    if result["method"] == "sft":
        return 0.0
    if result["method"] == "rpb":
        return float(result["anchor"].get("beta", AnchorConfig().beta))
    return None


def regret_table(results: list[dict], calibrated: dict[tuple[int, str], float]) -> str:
    """The beta rule against the best beta the grid ran, per (base, set): the criterion is mean(ID, OOD) on
    the validation part, per seed; the regret is the best beta's minus the rule's, with a seed-bootstrap
    interval; the rule agrees when that interval reaches 0. The best beta is picked on the same figures, so
    the regret leans against the rule."""
    by: dict[tuple[int, str, float], dict[int, float]] = {}
    for r in results:
        beta = _beta_of(r)
        if beta is None or "validation" not in r.get("scores", {}):
            continue
        v = r["scores"]["validation"]
        by.setdefault((r.get("base", 0), r["set"], beta), {})[r["seed"]] = 50.0 * (v["id"] + v["ood"])
    lines = [
        "| base | set | rule's beta | betas compared | best beta | regret (points) [95% CI over seeds] | agrees |",
        "|---|---|---|---|---|---|---|",
    ]
    for (base, post_set), rule_beta in sorted(calibrated.items()):
        grid = {b: seeds for (bb, s, b), seeds in by.items() if bb == base and s == post_set}
        label = f"{base} (in-sample)" if base == 0 else f"{base}"
        if rule_beta not in grid:
            lines.append(f"| {label} | {post_set} | {rule_beta:g} | — | — | not run | — |")
            continue
        best = max(sorted(grid), key=lambda b: statistics.fmean(grid[b].values()))
        seeds = sorted(set(grid[best]) & set(grid[rule_beta]))
        diffs = {0: [grid[best][s] - grid[rule_beta][s] for s in seeds]}
        lo, hi = interval(two_stage_bootstrap(diffs))
        regret = f"{statistics.fmean(diffs[0]):+.1f} [{lo:+.1f}, {hi:+.1f}]"
        compared = ", ".join(f"{b:g}" for b in sorted(grid))
        lines.append(
            f"| {label} | {post_set} | {rule_beta:g} | {compared} | {best:g} | {regret} | "
            f"{'yes' if lo <= 0 <= hi else 'no'} |"
        )
    return "\n".join(lines) + "\n"


def report_across(grid, studies: list, results: list[dict], out: Path) -> str:
    """tables.md, results.json, bases.json and the figures (rpb.toyworld.study.figures) across the bases; returns
    the tables. A grid with a report of its own (``Grid.report``) gets that one."""
    if grid.report is not None:
        return grid.report(grid, studies, results, out)
    arms = tuple(a.label for a in grid.arms)
    parts = [
        f"# Toy-world study: grid `{grid.name}` on bases {list(grid.bases)}",
        "",
        bases_table(studies),
        machine_mix(results),
        "",
    ]
    found = {s: differences(results, s, arms) for s in grid.sets}
    for s in grid.sets:
        parts.append(scores_table(results, s, arms, found[s]))
    if any("mechanism" in r for r in results):
        parts += [mechanism_table(results, s, arms) for s in grid.sets]
    calibrated = {
        (st.base_seed, s): st.calibrated_beta(s)
        for st in studies
        for s in grid.sets
        if any(a.calibrated for a in grid.arms) or grid.judges_beta_rule
    }
    if calibrated:
        parts += [
            "### Calibrated beta per base and set (`rpb calibrate`, rule in rpb/calibrate/rule.py)",
            "",
            "| base | " + " | ".join(grid.sets) + " |",
            "|---" * (len(grid.sets) + 1) + "|",
        ]
        for st in studies:
            parts.append(
                f"| {st.base_seed} | " + " | ".join(f"{calibrated[(st.base_seed, s)]:g}" for s in grid.sets) + " |"
            )
        parts.append("")
    if calibrated:
        parts += [
            "### The beta rule against the best beta the grid ran (criterion: mean of ID and OOD on the "
            "validation part; base 0 is in-sample: the rule was written knowing it)",
            "",
            regret_table(results, calibrated),
        ]
    if weights := weights_table(grid, studies):
        parts.append(weights)
    verdicts = (grid.claims or judge)(results, grid.sets)
    parts += ["### The paper's claims, judged by rule (docs/toyworld.md)", "", verdict_table(verdicts)]
    tables = "\n".join(parts)
    write_across(out, tables, results, studies)
    write_figures(out, f"Grid `{grid.name}`", [d for s in grid.sets for d in found[s]], verdicts)
    return tables


def load_results(out: Path) -> list[dict]:
    return json.loads((out / "results.json").read_text())


def study_kind(grid) -> type[Study]:
    """What runs one base of ``grid``: its own ``Study`` class (``Grid.study``), else a ``Study``."""
    return grid.study or Study


def studies(
    grid: Grid, out: Path, cache_dir=None, progress: bool = True, keep_checkpoints: bool = False, lanes: int = 1
) -> list[Study]:
    """One Study per base: in ``out`` itself for a one-base grid, in ``out/base<seed>/`` otherwise."""
    post = grid.post or PostRecipe()
    where = [Path(out)] if len(grid.bases) == 1 else [Path(out) / f"base{b}" for b in grid.bases]
    kind = study_kind(grid)
    return [
        kind(w, grid, post, cache_dir, progress, keep_checkpoints, base_seed=b, lanes=lanes)
        for w, b in zip(where, grid.bases, strict=True)
    ]


def cost(grid: Grid, sts: list[Study]) -> str:
    """What is left to run, and how long it should take: the mean minutes of the cells already finished
    (on this machine), or ``FIRST_ESTIMATE_MINUTES`` before the first one."""
    selection = sum(len(grid.candidates[k]) for k in sts[0].selected_keys())
    per_base = len(grid.sets) * len(grid.arms) * len(grid.seeds) + selection
    # the runs the plan owes, not every result.json under the folders: a grid's own extra cells (the hold grid's
    # retrained sft cells under revert/) are not runs of the plan, and counting them read "63 done, -4 to run"
    done = [json.loads(p.read_text()) for st in sts for p in cell_paths(st) if p.is_file()]
    minutes = [sum(r["seconds"].values()) / 60 for r in done if "seconds" in r]
    each = statistics.fmean(minutes) if minutes else FIRST_ESTIMATE_MINUTES
    left, lanes = per_base * len(sts) - len(done), max(sts[0].lanes, 1)
    return (
        f"grid {grid.name}: {len(sts)} base(s) x ({len(grid.sets)} set(s) x {len(grid.arms)} arm(s) x "
        f"{len(grid.seeds)} seed(s) + {selection} weight-selection run(s)) = {per_base * len(sts)} runs; "
        f"{len(done)} done, {left} to run, about {left * each / lanes:.0f} min on this machine "
        f"({each:.1f} min a run, {'measured on the finished ones' if minutes else 'a first estimate'}"
        f"{f', {lanes} side by side' if lanes > 1 else ''}), "
        "plus base pretraining where a base is neither cached nor shipped in bases/ (about 10 minutes "
        "each)"
    )


def run_grid(
    grid: Grid,
    out: Path,
    cache_dir=None,
    progress: bool = True,
    keep_checkpoints: bool = False,
    announce=print,
    lanes: int = 1,
    bases: list[int] | None = None,
) -> str:
    """Every base's cells (finished ones are read back), then the report; returns the tables. ``lanes``: runs
    side by side (rpb.toyworld.study.lanes). ``bases``: run only these of the grid's bases (one machine's share of
    it, each base pinned as in the whole grid) and write no report: it needs every base, brought together
    with ``rpb experiment --ship``."""
    sts = studies(grid, out, cache_dir, progress, keep_checkpoints, lanes)
    if bases is not None:
        unknown = sorted(set(bases) - set(grid.bases))
        if unknown:
            raise RpbError(f"grid {grid.name!r} has bases {list(grid.bases)}: no base {unknown}")
        sts = [st for st in sts if st.base_seed in bases]
    announce(cost(grid, sts))
    results = [r for st in sts for r in st.run()]
    if len(sts) < len(grid.bases):
        return (
            f"ran base(s) {[st.base_seed for st in sts]} of grid {grid.name!r} ({len(results)} cells) in "
            f"{out}: no report, which needs all of {list(grid.bases)}; `rpb experiment --ship DIR` brings "
            "each machine's bases together"
        )
    if len(sts) == 1:
        return sts[0].report(results)
    return report_across(grid, sts, results, Path(out))
