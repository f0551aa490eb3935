"""The beta-frequency grid's claim: its margins from the shipped beta cells, and the verdicts on hand-made cells."""

from __future__ import annotations

import json
import math
import statistics
from dataclasses import asdict
from pathlib import Path

import pytest
from scipy.stats import t as student_t

from rpb.toyworld.grids import grids
from rpb.toyworld.grids.beta_frequency import (
    FREQUENCY_BETAS,
    MARGINS,
    frequency_label,
    judge_frequency,
    margin_from,
    probability_label,
)
from rpb.toyworld.grids.beta_frequency import GRID as FREQUENCY_GRID

GRIDS = grids()

ROOT = Path(__file__).resolve().parents[3]


def test_the_margins_are_the_shipped_beta_cells_detectable_differences():
    """Recomputed by hand: the paired SD between each tested beta and its neighbours over the 18 (base, set, seed)
    pairs, (t_.975 + t_.8) * sd / sqrt(18), the larger neighbour's, rounded up to the half point."""
    results = json.loads((ROOT / "docs/results/beta/results.json").read_text())
    neighbours = {0.25: (0.0, 0.5), 1.0: (0.5, 2.0)}
    for beta in FREQUENCY_BETAS:
        for metric in ("id", "ood"):
            by = {(r["arm"], r["base"], r["set"], r["seed"]): 100 * r[metric] for r in results}
            mdds = []
            for other in neighbours[beta]:
                d = [
                    v - by[(probability_label(other), *key[1:])]
                    for key, v in by.items()
                    if key[0] == probability_label(beta)
                ]
                assert len(d) == 18
                q = student_t.ppf(0.975, 17) + student_t.ppf(0.8, 17)
                mdds.append(q * statistics.stdev(d) / math.sqrt(18))
            expected = math.ceil(2 * max(mdds)) / 2
            assert MARGINS[(beta, metric)] == expected == margin_from(results, beta, metric)
    # in domain the grid can only find large differences (the 3-point line)
    assert all(MARGINS[(b, "id")] > 3 for b in FREQUENCY_BETAS)


def test_the_grid_pairs_the_beta_grids_own_arms():
    beta_arms = {asdict(a)["label"]: asdict(a) for a in GRIDS["beta"].arms}
    probability = [a for a in FREQUENCY_GRID.arms if a.prior_kind == "probability"]
    frequency = [a for a in FREQUENCY_GRID.arms if a.prior_kind == "frequency"]
    assert [a.label for a in probability] == [probability_label(b) for b in FREQUENCY_BETAS]
    assert all(asdict(a) == beta_arms[a.label] for a in probability)  # the same arm, so the same training
    assert [dict(a.anchor)["beta"] for a in frequency] == list(FREQUENCY_BETAS)
    g, b = FREQUENCY_GRID, GRIDS["beta"]
    assert (g.sets, g.seeds, g.bases, g.post) == (b.sets, b.seeds, b.bases, b.post)
    cells = len(g.sets) * len(frequency) * len(g.seeds) * len(g.bases)
    assert cells == 36


def _cells(freq_minus_prob: dict[tuple[float, str], list[float]]) -> list[dict]:
    """Hand-made cells: probability at 40% / 20%, frequency shifted by the given points per (beta, metric)."""
    out = []
    i = 0
    for beta in FREQUENCY_BETAS:
        for base in (0, 1, 2):
            for post_set in ("a", "b"):
                for seed in (42, 43, 44):
                    shift = {m: freq_minus_prob[(beta, m)][i % len(freq_minus_prob[(beta, m)])] for m in ("id", "ood")}
                    i += 1
                    common = {"base": base, "set": post_set, "seed": seed, "method": "rpb"}
                    out.append({**common, "arm": probability_label(beta), "id": 0.4, "ood": 0.2})
                    out.append(
                        {
                            **common,
                            "arm": frequency_label(beta),
                            "id": 0.4 + shift["id"] / 100,
                            "ood": 0.2 + shift["ood"] / 100,
                        }
                    )
    return out


def test_verdicts_on_hand_made_cells():
    # frequency = probability up to a small spread: equivalent at the measured margins, not at ±1 where the
    # spread of ±4 points (the wide cells) keeps the interval past it
    small = {(b, m): [0.5, -0.5, 0.2, -0.2] for b in FREQUENCY_BETAS for m in ("id", "ood")}
    wide = {(b, m): [4.0, -4.0, 3.9, -4.1] for b in FREQUENCY_BETAS for m in ("id", "ood")}
    far = {(b, m): [9.0, 10.0, 11.0] for b in FREQUENCY_BETAS for m in ("id", "ood")}
    v = {x.claim: x for x in judge_frequency(_cells(small))}
    assert len(v) == 8 and all(x.verdict == "reproduces" for x in v.values())
    v = {x.claim: x for x in judge_frequency(_cells(wide))}
    assert v["frequency ≈ probability, beta 1, ID, margin ±6.5"].verdict == "reproduces"
    assert v["frequency ≈ probability, beta 1, ID, margin ±1"].verdict == "inconclusive"
    assert "detectable difference" in v["frequency ≈ probability, beta 1, ID, margin ±1"].note
    v = {x.claim: x for x in judge_frequency(_cells(far))}
    assert all(x.verdict == "contradicted" for x in v.values())
    assert v["frequency ≈ probability, beta 0.25, OOD, margin ±1.5"].estimate == pytest.approx(10.0)
    missing = [r for r in _cells(small) if not r["arm"].startswith("rpb-frequency beta=1")]
    v = {x.claim: x for x in judge_frequency(missing)}
    assert v["frequency ≈ probability, beta 1, OOD, margin ±2.5"].verdict == "not run"
