"""A reinforcement-learning grid's report across its bases (``rl.RLGrid``), from the cells' result files alone:
``tables.md`` (the bases, the ``sft`` starts, the chosen anchor weights, exact match and routing per arm, collapses,
the grid's claims judged by rule with the minimal detectable difference of each claim's pairs), ``results.json``
(the cells without their per-step curves, which stay in each cell's own file), ``bases.json``, ``rl.svg``
(``rl_figures``) and ``claims.svg`` (``figures.claims``)."""

from __future__ import annotations

import math
import statistics
from pathlib import Path

from rpb.toyworld.study.claims import verdict_table
from rpb.toyworld.study.figures import CLAIMS, claims, save
from rpb.toyworld.study.report import write_across
from rpb.toyworld.study.rl_figures import (
    RL_FIGURE,
    STALE_FIGURE,
    final_reward,
    has_stale_by_update,
    write_rl_figure,
    write_stale_figure,
)
from rpb.toyworld.study.stats import (
    interval,
    minimal_detectable_difference,
    paired_differences,
    points,
    relative_differences,
    two_stage_bootstrap,
)
from rpb.toyworld.study.tables import bases_table, machine_mix, mean_sd, weights_table

DOMAINS_SHOWN = ("math", "code", "text", "facts")
#: the routing columns: (label, the figure under ``result["retention"]``, digits)
ROUTING = (
    ("flip rate", "flip_rate", 3),
    ("log-p gap", "logp_gap", 4),
    ("top-k overlap with start", "start_topk_overlap", 3),
    ("TVD / JSD / NMI vs start", ("start_tvd", "start_jsd", "start_nmi"), 3),
    ("top-k overlap with base", "base_topk_overlap", 3),
    ("TVD / JSD / NMI vs base", ("base_tvd", "base_jsd", "base_nmi"), 3),
)


def reference_of(grid) -> str:
    """The arm every other is paired with in the scores table: the grid's ``reference``, else its first arm."""
    return grid.reference or grid.arms[0].label


def _difference(results: list[dict], post_set: str, arm: str, metric: str, plain: str) -> str:
    d = paired_differences(results, post_set, arm, plain, metric)
    if not d or arm == plain:
        return ""
    lo, hi = interval(two_stage_bootstrap(d))
    return f"{statistics.fmean([v for vs in d.values() for v in vs]):+.1f} [{lo:+.1f}, {hi:+.1f}]"


def starts_table(studies: list, recipe: str) -> str:
    """Each base's ``sft`` start: its weights and its exact match, where every arm of the base starts; ``recipe``:
    whose recipe trained it, in words."""
    lines = [
        f"### The starts: each base's `sft` cell ({recipe}), retrained at one thread",
        "",
        "| base | seed | weights sha256 | test ID % | test OOD % | validation ID % | validation OOD % |",
        "|---|---|---|---|---|---|---|",
    ]
    for st in studies:
        r = st.start_record()
        t, v = r["scores"]["test"], r["scores"]["validation"]
        lines.append(
            f"| {st.base_seed} | {r['seed']} | {r['weights_sha256'][:12]} | {100 * t['id']:.1f} | "
            f"{100 * t['ood']:.1f} | {100 * v['id']:.1f} | {100 * v['ood']:.1f} |"
        )
    return "\n".join(lines) + "\n"


def scores_table(results: list[dict], post_set: str, arms: tuple[str, ...], plain: str) -> str:
    """``plain``: the arm every other is paired with."""
    header = ["arm", "ID %", f"Δ ID vs {plain} [95% CI]", "OOD %", f"Δ OOD vs {plain} [95% CI]"]
    header += [f"{d} %" for d in DOMAINS_SHOWN] + ["final reward", "collapsed cells"]
    lines = [
        f"### {post_set}: exact match on the test part (mean ± sd over cells), each arm minus plain GRPO on the "
        "same base and seed",
        "",
        "| " + " | ".join(header) + " |",
        "|---" * len(header) + "|",
    ]
    for arm in arms:
        cells = [r for r in results if r["arm"] == arm and r["set"] == post_set]
        if not cells:
            continue
        row = [arm]
        for metric in ("id", "ood"):
            shown = mean_sd([points(r, metric) for r in cells], 1, "—")
            row += [shown, _difference(results, post_set, arm, metric, plain)]
        row += [mean_sd([100 * r["per_domain"][d] for r in cells], 1, "—") for d in DOMAINS_SHOWN]
        row.append(mean_sd([final_reward(r) for r in cells], 3, "—"))
        row.append(f"{sum(r['rl']['summary']['collapsed'] for r in cells)} of {len(cells)}")
        lines.append("| " + " | ".join(row) + " |")
    return "\n".join(lines) + "\n"


def routing_table(results: list[dict], arms: tuple[str, ...]) -> str:
    # the stale mismatch only where the cells record it (cells from before issue 64 do not: their tables stand)
    columns = ROUTING
    if any("stale_mismatch" in r.get("retention", {}) for r in results):
        columns = (ROUTING[0], ("stale mismatch", "stale_mismatch", 3), *ROUTING[1:])
    if any("override_rate" in r.get("retention", {}) for r in results):  # R3's, where cells record it
        columns = (columns[0], ("R3 override rate", "override_rate", 3), *columns[1:])
    lines = [
        "### Routing: through training (flip rate, log-probability gap: means over the steps) and after it, on "
        "the probe set against the `sft` start and against the base (mean ± sd over cells)",
        "",
        "| arm | " + " | ".join(label for label, _, _ in columns) + " |",
        "|---" * (len(columns) + 1) + "|",
    ]
    for arm in arms:
        cells = [r["retention"] for r in results if r["arm"] == arm and "retention" in r]
        if not cells:
            continue
        row = [arm]
        for _, keys, digits in columns:
            keys = keys if isinstance(keys, tuple) else (keys,)
            # a figure an arm's mode does not log (R3 logs no free flip rate) is "—", never a made-up value
            row.append(" / ".join(mean_sd([c[k] for c in cells if k in c], digits, "—") for k in keys))
        lines.append("| " + " | ".join(row) + " |")
    return "\n".join(lines) + "\n"


def detectable_table(results: list[dict], post_set: str, pairs) -> str:
    """The minimal detectable difference of each claim's pairs (α 0.05 two-sided, power 0.8, paired SD)."""
    lines = [
        "### What the grid could detect: each claim's pairs (α 0.05 two-sided, power 0.8, t on the paired SD)",
        "",
        "| claim | arm − reference | figure | pairs | paired SD | minimal detectable difference |",
        "|---|---|---|---|---|---|",
    ]
    for claim, arm, reference, metric, relative in pairs:
        if relative:
            d = relative_differences(results, post_set, arm, reference, metric)
        else:
            d = paired_differences(results, post_set, arm, reference, metric)
        flat = [v for vs in d.values() for v in vs]
        if len(flat) < 2 or any(math.isnan(v) for v in flat):  # a figure the cells do not record: the claim is not run
            continue
        sd, unit = statistics.stdev(flat), " (% of the reference)" if relative else ""
        lines.append(
            f"| {claim} | {arm} − {reference} | {metric}{unit} | {len(flat)} | {sd:.3g} | "
            f"{minimal_detectable_difference(sd, len(flat)):.3g} |"
        )
    return "\n".join(lines) + "\n"


def _compact(result: dict) -> dict:
    """A cell without its per-step curves (they stay in its own result file)."""
    return result | {"rl": {k: result["rl"][k] for k in ("summary", "arm", "seed", "settings", "seconds")}}


def report_rl(grid, studies: list, results: list[dict], out: Path) -> str:
    """tables.md, results.json, bases.json, rl.svg and claims.svg in ``out``; returns the tables."""
    arms = tuple(a.label for a in grid.arms)
    post_set = grid.sets[0]
    r = grid.recipe
    # a grid without claims of its own reports none (its claims table and figure say so)
    verdicts = grid.claims(results, grid.sets) if grid.claims else []
    source = grid.claims.__module__.replace(".", "/") + ".py" if grid.claims else "none declared"
    plain = reference_of(grid)
    iterations = {dict(a.trl).get("num_iterations", 1) for a in grid.arms}
    updates = " or ".join(str(r.steps_per_generation * i) for i in sorted(iterations))
    stale = has_stale_by_update(results)
    parts = [
        f"# Toy-world study: grid `{grid.name}` on bases {[st.base_seed for st in studies]}",
        "",
        f"GRPO from each base's `sft` cell on {post_set} (seed {grid.start_seed}), {r.max_steps} steps, "
        f"{r.prompts_per_step} prompts x {r.group_size} completions per step, {updates} updates per "
        f"generation batch, learning rate {r.lr:g}, temperature {r.temperature:g}, rollouts in {r.rollout_dtype}, "
        f"training in float32; exact-match reward on held-out prompts; {len(grid.seeds)} seeds {list(grid.seeds)}. "
        "ID = the set's test questions, OOD = the four pretraining domains' (docs/rl.md).",
        "",
        bases_table(studies),
        starts_table(studies, grid.start_recipe),
        weights_table(grid, studies),
        scores_table(results, post_set, arms, plain),
        routing_table(results, arms),
        f"### The claims, judged by rule (fixed before the first cell: {source})",
        "",
        verdict_table(verdicts, "claim (fixed before the grid ran, with its margin)"),
        detectable_table(results, post_set, grid.claim_pairs),
        machine_mix(results),
        "",
        f"![reward, flip rate and retention]({RL_FIGURE})",
        "",
        *([f"![the stale mismatch per update index]({STALE_FIGURE})", ""] if stale else []),
    ]
    tables = "\n".join(parts)
    out = Path(out)
    write_across(out, tables, results, studies, _compact)
    write_rl_figure(out, f"Grid `{grid.name}`", results)
    if stale:
        write_stale_figure(out, f"Grid `{grid.name}`", results)
    save(claims(verdicts, f"Grid `{grid.name}`"), out / CLAIMS)
    return tables
