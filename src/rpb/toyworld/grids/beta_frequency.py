"""``beta-frequency``: ``rpb`` with an engine's selection-frequency prior against the paper's probability
prior, at the same betas, bases, seeds and sets as the ``beta`` grid; and the claim it judges.

An engine (vLLM, SGLang) returns each token's chosen experts but no router probabilities, so a prior collected
from its routes counts selections (``rpb collect --from-routes``; ``prior_kind: frequency``). Whether ``rpb``
needs the probabilities is measured here, not assumed: 2 betas x 2 sets x 3 bases x 3 seeds = 36 frequency cells,
each paired with the ``beta`` grid's probability cell of the same (beta, set, base, seed). Those are the shipped
``beta`` grid's own cells, taken as they are where it pins the same base and recipe
(``rpb.toyworld.study.paired.PairedStudy``), so the shipped ``beta`` grid stays pinned and nothing is trained twice;
elsewhere they are trained here.

The claim (fixed before the grid's first cell): at each beta, frequency and probability priors are equivalent in
exact match, in domain and out of domain, by two one-sided tests on the paired differences (the grids' two-stage
bootstrap, ``rpb.toyworld.study.stats.equivalent``), with Holm across the claims. The margins are set from the shipped
``beta`` cells: the minimal detectable difference (α 0.05, power 0.8) of the 18 paired differences between the
tested beta and each of its neighbours in the beta grid (two cells of one seed that differ in their anchor only:
the noise a frequency-vs-probability pair shares), the larger of the two, rounded up to the half point
(``margin_from``). In domain that is 5.5 and 6.5 points: the grid can find only large in-domain differences. The
±1-point margins first asked for are judged too, beside them, and say what 18 pairs cannot show.
"""

from __future__ import annotations

import math
import statistics
from dataclasses import dataclass
from pathlib import Path
from typing import ClassVar

from rpb.toyworld.study.claims import verdict_table
from rpb.toyworld.study.figures import FOREST, Difference, write_figures
from rpb.toyworld.study.grid import BASES, BETAS, SEEDS, STUDY_POST, Arm, Grid
from rpb.toyworld.study.paired import PairedStudy
from rpb.toyworld.study.report import write_across
from rpb.toyworld.study.stats import (
    Verdict,
    equivalent,
    holm,
    interval,
    minimal_detectable_difference,
    not_run,
    paired_differences,
    points,
    two_stage_bootstrap,
)
from rpb.toyworld.study.tables import bases_table, machine_mix, mean_sd, mechanism_table
from rpb.toyworld.world.generators import POST_SETS

#: the betas the frequency prior is tried at
FREQUENCY_BETAS = (0.25, 1.0)
#: the grid whose probability cells the frequency cells are paired with
PAIRED_GRID = "beta"
#: the margin first asked for (points of exact match), judged beside the measured ones
ASKED_MARGIN = 1.0
#: the margins (points), per (beta, metric): ``margin_from`` on docs/results/beta (computed 2026-12-05, before the
#: grid's first cell; tests/toyworld/test_frequency.py recomputes them from the shipped cells)
# fmt: skip below: a table of data, one beta a row
MARGINS = {
    (0.25, "id"): 5.5, (0.25, "ood"): 1.5,
    (1.0, "id"): 6.5, (1.0, "ood"): 2.5,
}  # fmt: skip
METRICS = {"id": "ID", "ood": "OOD"}


@dataclass(frozen=True)
class FrequencyArm(Arm):
    """``rpb`` trained with the selection-frequency prior of the base over the same data."""

    prior_kind: ClassVar[str] = "frequency"


@dataclass(frozen=True)
class FrequencyGrid(Grid):
    """A grid whose probability arms are the paired grid's cells (``PairedStudy`` takes them as they are)."""

    paired_grid: ClassVar[str] = PAIRED_GRID


def probability_label(beta: float) -> str:
    """The ``beta`` grid's label of rpb at ``beta`` (``rpb.toyworld.grids.beta.BETA_ARMS``)."""
    return f"rpb beta={beta:g}"


def frequency_label(beta: float) -> str:
    return f"rpb-frequency beta={beta:g}"


FREQUENCY_ARMS = (
    *(Arm(probability_label(b), "rpb", (("beta", b),)) for b in FREQUENCY_BETAS),
    *(FrequencyArm(frequency_label(b), "rpb", (("beta", b),)) for b in FREQUENCY_BETAS),
)


def pooled_differences(results: list[dict], arm: str, reference: str, metric: str) -> dict[int, list[float]]:
    """{base: differences} of ``arm`` minus ``reference`` over every set (each base's sets and seeds pooled: the
    bootstrap resamples bases, then these within them)."""
    out: dict[int, list[float]] = {}
    for post_set in sorted({r["set"] for r in results}):
        for base, values in paired_differences(results, post_set, arm, reference, metric).items():
            out.setdefault(base, []).extend(values)
    return out


def margin_from(beta_results: list[dict], beta: float, metric: str) -> float:
    """The margin for ``beta`` and ``metric`` from the ``beta`` grid's cells: the larger minimal detectable
    difference of the paired differences between ``beta`` and each neighbour in ``BETAS``, rounded up to 0.5."""
    i = BETAS.index(beta)
    mdds = []
    for other in (BETAS[j] for j in (i - 1, i + 1) if 0 <= j < len(BETAS)):
        d = pooled_differences(beta_results, probability_label(beta), probability_label(other), metric)
        flat = [v for vs in d.values() for v in vs]
        mdds.append(minimal_detectable_difference(statistics.stdev(flat), len(flat)))
    return math.ceil(2 * max(mdds)) / 2


def detectable(diffs: dict[int, list[float]]) -> float:
    """The minimal detectable difference (points) of these paired differences."""
    flat = [v for vs in diffs.values() for v in vs]
    return minimal_detectable_difference(statistics.stdev(flat), len(flat)) if len(flat) > 1 else math.nan


def judge_frequency(results: list[dict]) -> list[Verdict]:
    """Frequency ≈ probability at each beta, ID and OOD, at the measured margin and at ±1 point; Holm across all.
    A pair missing on either side is "not run"."""
    verdicts = []
    for beta in FREQUENCY_BETAS:
        for metric, name in METRICS.items():
            d = pooled_differences(results, frequency_label(beta), probability_label(beta), metric)
            for margin in (MARGINS[(beta, metric)], ASKED_MARGIN):
                claim = f"frequency ≈ probability, beta {beta:g}, {name}, margin ±{margin:g}"
                if not d:
                    verdicts.append(not_run(claim))
                    continue
                note = f"{sum(map(len, d.values()))} pairs; detectable difference {detectable(d):.1f}"
                verdicts.append(equivalent(claim, d, margin, note))
    return holm(verdicts)


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
        "difference between each tested beta and its neighbours (rpb/toyworld/grids/beta_frequency.py): "
        f"{detail}. In domain they are above 3 points: this grid can find only large in-domain differences. The ±"
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
    write_across(out, tables, results, studies)
    write_figures(out, f"Grid `{grid.name}`: frequency minus probability prior", differences(results), verdicts)
    return tables


GRID = FrequencyGrid(
    "beta-frequency",
    POST_SETS,
    FREQUENCY_ARMS,
    SEEDS,
    coefficients={},
    tables=("beta-frequency",),
    bases=BASES,
    post=STUDY_POST,
    about="rpb with the selection-frequency prior at betas 0.25 and 1, paired with the beta grid's cells",
    study=PairedStudy,
    report=report_frequency,
)
