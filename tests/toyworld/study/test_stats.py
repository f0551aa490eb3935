"""Paired differences, the two-stage bootstrap, detectable differences and the verdict rules, on hand cases."""

from __future__ import annotations

import math

import numpy as np
import pytest
from scipy.stats import t as student_t

from rpb.toyworld.study import stats


def cell(arm, base, seed, id_, ood=0.5, nmi=0.5):
    return {"set": "s", "arm": arm, "base": base, "seed": seed, "id": id_, "ood": ood, "retention": {"nmi": nmi}}


def test_paired_differences_pair_the_same_base_and_seed_in_points():
    results = [
        cell("sft", 0, 1, 0.30),
        cell("rpb", 0, 1, 0.35),
        cell("sft", 1, 1, 0.50),
        cell("rpb", 1, 1, 0.40),
        cell("rpb", 2, 1, 0.9),
    ]  # no sft on base 2: unpaired, left out
    d = stats.paired_differences(results, "s", "rpb", "sft", "id")
    assert d.keys() == {0, 1} and d[0] == pytest.approx([5.0]) and d[1] == pytest.approx([-10.0])


def test_two_stage_bootstrap_resamples_bases_then_seeds():
    assert np.all(stats.two_stage_bootstrap({0: [3.0, 3.0], 1: [3.0]}) == 3.0)  # no spread, no interval
    boot = stats.two_stage_bootstrap({0: [0.0, 0.0, 0.0], 1: [10.0, 10.0, 10.0]}, resamples=20_000)
    # seeds never vary within a base, so each resample is the mean of two drawn bases: 0, 5 or 10
    assert set(np.unique(boot)) <= {0.0, 5.0, 10.0}
    assert np.mean(boot == 5.0) == pytest.approx(0.5, abs=0.02) and np.mean(boot == 0.0) == pytest.approx(
        0.25, abs=0.02
    )
    assert np.array_equal(
        boot, stats.two_stage_bootstrap({0: [0.0, 0.0, 0.0], 1: [10.0, 10.0, 10.0]}, resamples=20_000)
    )


def _one_at_a_time(diffs: dict[int, list[float]], resamples: int, seed: int = 0) -> np.ndarray:
    """The bootstrap as first written (and as the shipped reports were made): numpy's draws one base at a time."""
    rng = np.random.default_rng(seed)
    per_base = [np.asarray(v, dtype=float) for _, v in sorted(diffs.items())]
    drawn = rng.integers(len(per_base), size=(resamples, len(per_base)))
    return np.array(
        [np.concatenate([per_base[b][rng.integers(len(per_base[b]), size=len(per_base[b]))] for b in row]).mean()
         for row in drawn]
    )  # fmt: skip


@pytest.mark.parametrize("shape", [(3, 3), (3, 5), (2, 1), (5, 6), "ragged"])
def test_the_bootstrap_draws_what_one_draw_at_a_time_draws_bit_for_bit(shape):
    """Drawing every seed in one call takes the same values from the generator's stream, and each mean sums them
    in the same order: the figures of the shipped reports stay the same to the last bit."""
    rng = np.random.default_rng(7)
    sizes = [3, 5, 2] if shape == "ragged" else [shape[1]] * shape[0]
    diffs = {b: list(rng.normal(0, 10, n).round(1)) for b, n in enumerate(sizes)}
    got = stats.two_stage_bootstrap(diffs, resamples=2_000, seed=3)
    assert got.tobytes() == _one_at_a_time(diffs, 2_000, seed=3).tobytes()


def test_minimal_detectable_difference_is_the_paired_t_formula():
    expected = (student_t.ppf(0.975, 8) + student_t.ppf(0.8, 8)) * 10.0 / 3.0
    assert stats.minimal_detectable_difference(10.0, 9) == pytest.approx(expected) == pytest.approx(10.65, abs=0.01)
    assert math.isnan(stats.minimal_detectable_difference(10.0, 1))


def test_greater_reproduces_contradicts_or_stays_inconclusive():
    assert stats.greater("c", {0: [5, 6, 7], 1: [4, 5, 6], 2: [6, 6, 7]}).verdict == "reproduces"
    assert stats.greater("c", {0: [-5, -6, -7], 1: [-4, -5, -6], 2: [-6, -6, -7]}).verdict == "contradicted"
    assert stats.greater("c", {0: [5, -6, 7], 1: [-4, 5, -6], 2: [6, -6, 1]}).verdict == "inconclusive"
    # the pooled interval above 0, yet one base's own mean below it: not reproduced
    one_base_against = {0: [9, 9, 9], 1: [9, 9, 9], 2: [-0.5, -0.5, -0.5], 3: [9, 9, 9], 4: [9, 9, 9]}
    v = stats.greater("c", one_base_against)
    assert v.ci[0] > 0 and v.verdict == "inconclusive"
    assert stats.greater("lbl below", {0: [-5, -6], 1: [-4, -5]}, direction=-1).verdict == "reproduces"


def test_equivalence_well_below_and_extremes():
    assert stats.equivalent("c", {0: [0.1, -0.2, 0.3], 1: [0.0, 0.2, -0.1]}).verdict == "reproduces"
    assert stats.equivalent("c", {0: [9, 10, 11], 1: [10, 9, 11]}).verdict == "contradicted"
    assert stats.equivalent("c", {0: [-3, 3, 0], 1: [2, -2, 4]}).verdict == "inconclusive"
    assert stats.well_below("c", {0: [-10, -12], 1: [-11, -9]}).verdict == "reproduces"
    assert stats.well_below("c", {0: [-1, 0], 1: [1, -2]}).verdict == "contradicted"
    lowest = stats.extreme("c", {"a": {0: [-5, -6], 1: [-5, -4]}, "b": {0: [-1, -2], 1: [-1, -2]}}, -1)
    assert lowest.verdict == "reproduces" and "closest: b" in lowest.note
    assert (
        stats.extreme("c", {"a": {0: [-5, -6], 1: [-5, -4]}, "b": {0: [3, 2], 1: [2, 4]}}, -1).verdict == "contradicted"
    )


def test_holm_keeps_only_what_the_step_down_rejects():
    vs = [stats.Verdict(f"c{i}", 1.0, (0.5, 1.5), p, "reproduces") for i, p in enumerate([0.01, 0.02, 0.04])]
    vs.append(stats.Verdict("c3", 0.0, (-1, 1), 0.5, "inconclusive"))
    stats.holm(vs)
    # four p-values: 0.01 <= .05/4, then 0.02 > .05/3: the step-down stops there
    assert [v.holm for v in vs] == ["reproduces", "inconclusive", "inconclusive", "inconclusive"]
    two = [stats.Verdict(f"c{i}", 1.0, (0.5, 1.5), p, "reproduces") for i, p in enumerate([0.01, 0.02])]
    assert [v.holm for v in stats.holm(two)] == ["reproduces", "reproduces"]  # 0.01 <= .05/2, 0.02 <= .05/1


def test_claims_beside_the_family_keep_their_verdict_and_take_no_part_in_its_holm():
    family = [stats.Verdict(f"c{i}", 1.0, (0.5, 1.5), p, "reproduces") for i, p in enumerate([0.01, 0.03])]
    outside = [stats.Verdict("o", 1.0, (0.5, 1.5), 0.001, "reproduces"), stats.not_run("o2")]
    out = stats.holm_beside(family, outside)
    # the family alone: 0.01 <= .05/2 and 0.03 <= .05/1, both kept; had the outside claim's p 0.001 been counted,
    # 0.03 would face .05/2 and fall
    assert [v.holm for v in out] == ["reproduces", "reproduces", "outside Holm", "not run"]
    assert [v.note for v in out[2:]] == [stats.OUTSIDE_NOTE] * 2 and out[2].verdict == "reproduces"


def _t_sf_df2(t):
    """P(T > t) for Student's t with 2 degrees of freedom, in closed form: (1 - t / sqrt(2 + t^2)) / 2."""
    return (1 - t / math.sqrt(2 + t * t)) / 2


def test_t_over_base_means_is_the_conservative_cross_check():
    # base means 2, 3, 5: mean 10/3, sd sqrt(7/3), t = (10/3) / (sd / sqrt 3) against 0
    diffs = {0: [1.0, 2.0, 3.0], 1: [2.0, 3.0, 4.0], 2: [4.0, 5.0, 6.0]}
    t = (10 / 3) / (math.sqrt(7 / 3) / math.sqrt(3))
    assert stats.t_p(diffs) == pytest.approx(2 * _t_sf_df2(t))  # 0.0634
    v = stats.greater("c", diffs)
    # three bases of one sign: the bootstrap says reproduces at p 0.0002, t over the bases does not reject
    assert v.verdict == "reproduces" and v.p < 0.001 and v.p_t == pytest.approx(0.0634, abs=1e-4)
    # equivalence within 2 points: two one-sided t tests, the larger p
    near = {0: [0.0], 1: [1.0], 2: [-1.0]}  # mean 0, sd 1: t = 2 / (1 / sqrt 3) on both sides
    assert stats.equivalent("c", near).p_t == pytest.approx(_t_sf_df2(2 * math.sqrt(3)))
    # well below -5: one-sided, the mean's distance below the threshold
    low = {0: [-7.0], 1: [-8.0], 2: [-9.0]}  # mean -8, sd 1: t = 3 / (1 / sqrt 3)
    assert stats.well_below("c", low).p_t == pytest.approx(_t_sf_df2(3 * math.sqrt(3)))
    # one base (or no spread between bases): no t
    assert math.isnan(stats.t_p({0: [1.0, 2.0, 3.0]})) and math.isnan(stats.t_p({0: [1.0], 1: [1.0]}))
    lowest = stats.extreme("c", {"a": diffs, "b": {0: [1.0, 1.0]}}, +1)
    assert math.isnan(lowest.p_t)  # one pairwise comparison without a t: none for the claim
