"""The ``revert`` grid's report across its bases: tables.md, results.json, bases.json, revert.svg (the change in
answer NLL from reverting, per arm and domain, with the grids' two-stage bootstrap interval over bases and seeds)
and claims.svg (the claim of ``rpb.toyworld.revert``, judged)."""

from __future__ import annotations

import functools
import json
import math
from pathlib import Path

import numpy as np

from rpb.fileio import write_json_atomic, write_text_atomic
from rpb.toyworld.claims import verdict_table
from rpb.toyworld.figures import CLAIMS, _figure, _style, _unique, claims, save
from rpb.toyworld.frequency_study import SHIPPED_RESULTS
from rpb.toyworld.revert import judge_revert, per_base
from rpb.toyworld.stats import interval, two_stage_bootstrap
from rpb.toyworld.tables import bases_table, machine_mix, mean_sd

REVERT_FIGURE = "revert.svg"
#: the shipped grid each arm's cells come from (their scores are the retrained cells' reference)
SOURCE_GRID = {"sft": "full", "rpb": "full", "kl-to-base": "full", "grpo": "rl", "grpo + R3": "rl"}


def _mean(results: list[dict], arm: str, reference: str, domain: str, key: str) -> float:
    return float(np.mean([v for vs in per_base(results, arm, reference, domain, key).values() for v in vs]))


def estimate(d: dict[int, list[float]]) -> tuple[float, float, float]:
    """The mean and the two-stage bootstrap interval (NaN where there is no cell); the same cells' bootstrap is
    drawn once for the tables and the figure."""
    return _estimate(tuple((b, tuple(v)) for b, v in sorted(d.items())))


@functools.lru_cache(maxsize=256)
def _estimate(frozen: tuple[tuple[int, tuple[float, ...]], ...]) -> tuple[float, float, float]:
    if not frozen:
        return math.nan, math.nan, math.nan
    d = {b: list(v) for b, v in frozen}
    lo, hi = interval(two_stage_bootstrap(d))
    return float(np.mean([v for vs in d.values() for v in vs])), lo, hi


def shipped_cell(result: dict, shipped: Path = SHIPPED_RESULTS) -> dict | None:
    """The shipped ``full`` / ``rl`` grid's cell this retrained cell repeats, if the repository ships it."""
    slug = result["arm"].replace(" + ", "+").replace(" ", "")
    path = shipped / SOURCE_GRID[result["arm"]] / f"base{result['base']}" / "runs" / result["set"] / slug
    path = path / f"seed{result['seed']}" / "result.json"
    return json.loads(path.read_text()) if path.is_file() else None


def scores_table(results: list[dict], arms: tuple[str, ...]) -> str:
    lines = [
        "### Exact match of the retrained cells (test part, points) beside the shipped cells they repeat",
        "",
        "| arm | cells | ID | OOD | largest \\|Δ\\| to the shipped cell, ID / OOD | cells bit-identical in score |",
        "|---|---|---|---|---|---|",
    ]
    for arm in arms:
        cells = [r for r in results if r["arm"] == arm]
        pairs = [(r, shipped_cell(r)) for r in cells]
        pairs = [(r, s) for r, s in pairs if s is not None]
        gaps = [max(abs(r[m] - s[m]) * 100 for r, s in pairs) if pairs else float("nan") for m in ("id", "ood")]
        same = sum(r["scores"] == s["scores"] for r, s in pairs)
        lines.append(
            f"| {arm} | {len(cells)} | {mean_sd([100 * r['id'] for r in cells])} | "
            f"{mean_sd([100 * r['ood'] for r in cells])} | {gaps[0]:.1f} / {gaps[1]:.1f} | {same} of {len(pairs)} |"
        )
    return "\n".join(lines) + "\n"


def delta_table(results: list[dict], arms: tuple[str, ...], domains: tuple[str, ...], reference: str) -> str:
    """ΔNLL (reverted − post, nats per answer token) per arm and domain, with the overlap to the base before and after
    and exact match before and after (points)."""
    other = "post+base routers"
    lines = [
        f"### Reverted to the {reference}'s routers: ΔNLL = reverted − post (answer span, nats/token), 95% two-stage "
        f"bootstrap over bases and seeds; top-k overlap to the {reference}'s routing and exact match (points), "
        "post → reverted",
        "",
        f"| arm | domain | ΔNLL | overlap to the {reference} | exact match |",
        "|---|---|---|---|---|",
    ]
    for arm in arms:
        for d in domains:
            delta = per_base(results, arm, reference, d)
            if not delta:
                continue
            est, lo, hi = estimate(delta)
            ov = [_mean(results, arm, reference, d, f"{v}/topk_overlap") for v in ("post", other)]
            em = [100 * _mean(results, arm, reference, d, f"{v}/exact_match") for v in ("post", other)]
            lines.append(
                f"| {arm} | {d}{' (trained)' if d == domains[0] else ''} | {est:+.4f} [{lo:+.4f}, {hi:+.4f}] | "
                f"{ov[0]:.3f} → {ov[1]:.3f} | {em[0]:.1f} → {em[1]:.1f} |"
            )
    return "\n".join(lines) + "\n"


def revert_figure(results: list[dict], domains: tuple[str, ...], title: str, arms: tuple[str, ...] = ()):
    """ΔNLL from reverting to the base's routers per domain (x) and arm (bars, in ``arms``' order, then any other
    arm of the cells), with intervals."""
    arms = _unique([*arms, *(r["arm"] for r in results)])
    with _style():
        fig = _figure(1.6 + 1.5 * len(domains), 3.6)
        ax = fig.subplots()
        width = 0.8 / max(len(arms), 1)
        for i, arm in enumerate(arms):
            found = [(j, estimate(per_base(results, arm, "base", d))) for j, d in enumerate(domains)]
            found = [(j, e) for j, e in found if not np.isnan(e[0])]
            xs = [j - 0.4 + width * (i + 0.5) for j, _ in found]
            est = [e[0] for _, e in found]
            err = [[e[0] - e[1] for _, e in found], [e[2] - e[0] for _, e in found]]
            ax.bar(xs, est, width, label=arm)
            ax.errorbar(xs, est, yerr=err, fmt="none", ecolor="black", capsize=2, lw=0.8)
        ax.axhline(0, color="grey", lw=0.8)
        ax.set_xticks(range(len(domains)), [f"{d}\n(trained)" if j == 0 else d for j, d in enumerate(domains)])
        ax.set_ylabel("ΔNLL, reverted − post (nats/token)")
        ax.set_title(f"{title}: the base's routers put back (95% two-stage bootstrap)")
        ax.legend(fontsize=7, ncol=len(arms))
    return fig


def report_revert(grid, studies: list, results: list[dict], out: Path) -> str:
    """tables.md, results.json, bases.json, revert.svg and claims.svg in ``out``; returns the tables."""
    arms = tuple(a.label for a in grid.arms)
    rl_arms = tuple(a for a in arms if any("start" in r["revert"] for r in results if r["arm"] == a))
    verdicts = judge_revert(results)
    parts = [
        f"# Toy-world study: grid `{grid.name}` on bases {[st.base_seed for st in studies]}",
        "",
        f"Each cell retrained as the shipped grid trains it ({', '.join(f'{a}: {SOURCE_GRID[a]}' for a in arms)}), "
        f"{len(grid.seeds)} seeds {list(grid.seeds)}, then run with the base's routers put back "
        "(`rpb retention --revert-routers`; the RL arms also with their sft start's). Domains: the trained set's "
        "500 test questions and 300 of each pretraining domain; NLL on the answer span (docs/retention.md).",
        "",
        bases_table(studies),
        scores_table(results, arms),
        delta_table(results, arms, grid.domains, "base"),
        delta_table(results, rl_arms, grid.domains, "start") if rl_arms else "",
        "### The claims, judged by rule (fixed before the first cell: rpb/toyworld/revert.py)",
        "",
        verdict_table(verdicts, "claim (fixed before the grid ran)"),
        machine_mix(results),
        "",
        f"![ΔNLL from reverting]({REVERT_FIGURE})",
        "",
    ]
    tables = "\n".join(parts)
    out = Path(out)
    write_text_atomic(out / "tables.md", tables)
    ordered = sorted(results, key=lambda c: (c.get("base", 0), c["set"], c["arm"], c["seed"]))
    write_json_atomic(out / "results.json", [{k: v for k, v in c.items() if k != "rl"} for c in ordered])
    write_json_atomic(out / "bases.json", {st.base_seed: st.base_facts() for st in studies})
    save(revert_figure(results, grid.domains, f"Grid `{grid.name}`", arms), out / REVERT_FIGURE)
    save(claims(verdicts, f"Grid `{grid.name}`"), out / CLAIMS)
    return tables
