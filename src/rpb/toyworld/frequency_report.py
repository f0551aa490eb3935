"""The ``beta-frequency`` grid's report across its bases, from the cells' result files alone: ``tables.md`` (the
bases, exact match of the frequency and probability cells per beta and set with their paired differences, what the
bias did to the routing, the claims with each pair's minimal detectable difference), ``results.json``,
``bases.json``, ``forest.svg`` (frequency minus probability, per beta, set and metric) and ``claims.svg``."""

from __future__ import annotations

import statistics
from pathlib import Path

from rpb.fileio import write_json_atomic, write_text_atomic
from rpb.toyworld.claims import verdict_table
from rpb.toyworld.figures import FOREST, Difference, write_figures
from rpb.toyworld.frequency import (
    ASKED_MARGIN,
    FREQUENCY_BETAS,
    MARGINS,
    METRICS,
    PAIRED_GRID,
    detectable,
    frequency_label,
    judge_frequency,
    pooled_differences,
    probability_label,
)
from rpb.toyworld.stats import interval, paired_differences, points, two_stage_bootstrap
from rpb.toyworld.tables import bases_table, machine_mix, mean_sd, mechanism_table

RETENTION = (("top-k overlap with base", "topk_overlap"), ("TVD", "tvd"), ("NMI", "nmi"))


def differences(results: list[dict]) -> list[Difference]:
    """Frequency minus probability per beta, set and metric (the forest's rows), with the two-stage interval."""
    found = []
    for beta in FREQUENCY_BETAS:
        for post_set in sorted({r["set"] for r in results}):
            for metric in METRICS:
                d = paired_differences(results, post_set, frequency_label(beta), probability_label(beta), metric)
                if d:
                    lo, hi = interval(two_stage_bootstrap(d))
                    found.append(
                        Difference(post_set, frequency_label(beta), metric, probability_label(beta), d, lo, hi)
                    )
    return found


def _estimate(d: dict[int, list[float]]) -> str:
    if not d:
        return "—"
    lo, hi = interval(two_stage_bootstrap(d))
    return f"{statistics.fmean([v for vs in d.values() for v in vs]):+.1f} [{lo:+.1f}, {hi:+.1f}]"


def scores_table(results: list[dict], sets: tuple[str, ...]) -> str:
    """Each (beta, set) and both sets pooled: exact match of the two kinds and their paired difference."""
    lines = [
        "### Exact match: the frequency prior and the probability prior at the same beta (mean ± sd over cells), "
        "and frequency minus probability on the same base and seed (95% CI, two-stage bootstrap)",
        "",
        "| beta | set | ID % probability | ID % frequency | Δ ID | OOD % probability | OOD % frequency | Δ OOD |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for beta in FREQUENCY_BETAS:
        for post_set in (*sets, "both"):
            cells = [r for r in results if post_set == "both" or r["set"] == post_set]
            row = [f"{beta:g}", post_set]
            for metric in METRICS:
                for label in (probability_label(beta), frequency_label(beta)):
                    row.append(mean_sd([points(r, metric) for r in cells if r["arm"] == label]))
                d = pooled_differences(cells, frequency_label(beta), probability_label(beta), metric)
                row.append(_estimate(d))
            lines.append("| " + " | ".join(row) + " |")
    return "\n".join(lines) + "\n"


def retention_table(results: list[dict]) -> str:
    """The cells' routing retention against the base on the probe set, per arm (both sets)."""
    lines = [
        "### Routing retention against the base (probe set; mean ± sd over cells, both sets)",
        "",
        "| arm | " + " | ".join(name for name, _ in RETENTION) + " |",
        "|---" * (len(RETENTION) + 1) + "|",
    ]
    for beta in FREQUENCY_BETAS:
        for label in (probability_label(beta), frequency_label(beta)):
            cells = [r for r in results if r["arm"] == label]
            lines.append(
                f"| {label} | " + " | ".join(mean_sd([points(r, k) for r in cells], 3) for _, k in RETENTION) + " |"
            )
    return "\n".join(lines) + "\n"


def margins_text() -> str:
    detail = "; ".join(f"beta {b:g}: ID ±{MARGINS[(b, 'id')]:g}, OOD ±{MARGINS[(b, 'ood')]:g}" for b in FREQUENCY_BETAS)
    return (
        f"Margins (points), fixed before the first cell from the shipped `{PAIRED_GRID}` cells' minimal detectable "
        f"difference between each tested beta and its neighbours (rpb/toyworld/frequency.py): {detail}. In domain "
        "they are above 3 points: this grid can find only large in-domain differences. The ±"
        f"{ASKED_MARGIN:g}-point claims are judged beside them; each row's note gives its pairs' own detectable "
        "difference."
    )


def report_frequency(grid, studies: list, results: list[dict], out: Path) -> str:
    """tables.md, results.json, bases.json and the figures in ``out``; returns the tables."""
    sets = grid.sets
    verdicts = judge_frequency(results)
    pooled = {
        (b, m): pooled_differences(results, frequency_label(b), probability_label(b), m)
        for b in FREQUENCY_BETAS
        for m in METRICS
    }
    mdd = "; ".join(
        f"beta {b:g} {name} {detectable(pooled[(b, m)]):.1f}"
        for b in FREQUENCY_BETAS
        for m, name in METRICS.items()
        if pooled[(b, m)]
    )
    parts = [
        f"# Toy-world study: grid `{grid.name}` on bases {list(grid.bases)}",
        "",
        f"`rpb` with the selection-frequency prior (what an engine's routes give) against the probability prior, "
        f"paired cell by cell; the probability cells are the `{PAIRED_GRID}` grid's own.",
        "",
        f"![Frequency minus probability prior per beta and set, exact-match points, 95% intervals]({FOREST})",
        "",
        bases_table(studies),
        machine_mix(results),
        "",
        scores_table(results, sets),
        f"Minimal detectable difference of frequency minus probability (both sets pooled; α 0.05 two-sided, "
        f"power 0.8), points: {mdd or 'n/a'}",
        "",
        retention_table(results),
        *(mechanism_table(results, s, tuple(a.label for a in grid.arms)) for s in sets),
        "### The claims, judged by rule (two one-sided tests, Holm across the rows)",
        "",
        margins_text(),
        "",
        verdict_table(verdicts, claim="claim (frequency vs probability)"),
    ]
    tables = "\n".join(parts)
    write_text_atomic(out / "tables.md", tables)
    write_json_atomic(
        out / "results.json", sorted(results, key=lambda r: (r.get("base", 0), r["set"], r["arm"], r["seed"]))
    )
    write_json_atomic(out / "bases.json", {st.base_seed: st.base_facts() for st in studies})
    write_figures(out, f"Grid `{grid.name}`: frequency minus probability prior", differences(results), verdicts)
    return tables
