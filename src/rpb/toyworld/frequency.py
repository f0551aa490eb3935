"""The ``beta-frequency`` grid: ``rpb`` with an engine's selection-frequency prior against the paper's probability
prior, at the same betas, bases, seeds and sets as the ``beta`` grid; and the claim it judges.

An engine (vLLM, SGLang) returns each token's chosen experts but no router probabilities, so a prior collected
from its routes counts selections (``rpb collect --from-routes``; ``prior_kind: frequency``). Whether ``rpb``
needs the probabilities is measured here, not assumed: 2 betas x 2 sets x 3 bases x 3 seeds = 36 frequency cells,
each paired with the ``beta`` grid's probability cell of the same (beta, set, base, seed). Those are the shipped
``beta`` grid's own cells, taken as they are where it pins the same base and recipe (``FrequencyStudy``), so the
shipped ``beta`` grid stays pinned and nothing is trained twice; elsewhere they are trained here.

The claim (fixed before the grid's first cell): at each beta, frequency and probability priors are equivalent in
exact match, in domain and out of domain, by two one-sided tests on the paired differences (the grids' two-stage
bootstrap, ``rpb.toyworld.stats.equivalent``), with Holm across the claims. The margins are set from the shipped
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
from typing import ClassVar

from rpb.toyworld.generators import POST_SETS
from rpb.toyworld.grids import BASES, BETAS, SEEDS, STUDY_POST, Arm, Grid
from rpb.toyworld.stats import Verdict, equivalent, holm, minimal_detectable_difference, paired_differences

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
    """A grid whose probability arms are the paired grid's cells (``FrequencyStudy`` takes them as they are)."""

    paired_grid: ClassVar[str] = PAIRED_GRID


def probability_label(beta: float) -> str:
    """The ``beta`` grid's label of rpb at ``beta`` (``rpb.toyworld.grids.BETA_ARMS``)."""
    return f"rpb beta={beta:g}"


def frequency_label(beta: float) -> str:
    return f"rpb-frequency beta={beta:g}"


FREQUENCY_ARMS = (
    *(Arm(probability_label(b), "rpb", (("beta", b),)) for b in FREQUENCY_BETAS),
    *(FrequencyArm(frequency_label(b), "rpb", (("beta", b),)) for b in FREQUENCY_BETAS),
)
FREQUENCY_GRID = FrequencyGrid(
    "beta-frequency",
    POST_SETS,
    FREQUENCY_ARMS,
    SEEDS,
    coefficients={},
    tables=("beta-frequency",),
    bases=BASES,
    post=STUDY_POST,
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
                    verdicts.append(Verdict(claim, math.nan, (math.nan, math.nan), math.nan, "not run"))
                    continue
                note = f"{sum(map(len, d.values()))} pairs; detectable difference {detectable(d):.1f}"
                verdicts.append(equivalent(claim, d, margin, note))
    return holm(verdicts)
