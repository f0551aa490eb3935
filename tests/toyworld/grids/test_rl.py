"""The rl grid's claims and collapse rule on hand-made cells: each verdict follows from differences built to
give it, and the collapse rule from reward curves drawn by hand."""

from __future__ import annotations

import math

import pytest

from rpb.toyworld.grids.rl import ANCHORED, PLAIN, collapsed, judge_rl
from rpb.toyworld.study.stats import cost_under, relative_differences

BASES, SEEDS = (0, 1, 2), (42, 43, 44)


def cells(shift: dict[str, dict[str, float]]) -> list[dict]:
    """Every arm on 3 bases x 3 seeds: plain GRPO's figures plus ``shift[arm][metric]``, with a small seeded
    spread so that no interval is degenerate."""
    out = []
    for arm in (PLAIN, *ANCHORED, "gspo"):
        for b in BASES:
            for s in SEEDS:
                wobble = ((b * 7 + s * 3) % 5 - 2) * 0.05
                f = {"id": 50.0, "ood": 25.0, "start_topk_overlap": 0.8, "flip_rate": 0.13, "logp_gap": 0.02}
                f = {k: v + shift.get(arm, {}).get(k, 0.0) + wobble * (0.01 if k not in ("id", "ood") else 1) * 0.1
                     for k, v in f.items()}  # fmt: skip
                out.append({"set": "math_post", "arm": arm, "base": b, "seed": s, "id": f["id"] / 100,
                            "ood": f["ood"] / 100, "retention": {k: f[k] for k in
                            ("start_topk_overlap", "flip_rate", "logp_gap")}})  # fmt: skip
    return out


def by_number(verdicts):
    return {v.claim.split(" ")[0]: v.verdict for v in verdicts}


def test_each_claim_reproduces_where_the_cells_say_so():
    anchored_overlap = {a: {"start_topk_overlap": 0.1} for a in ANCHORED}
    shift = anchored_overlap | {
        "grpo + R3": {"start_topk_overlap": 0.1, "flip_rate": -0.1, "logp_gap": -0.01, "id": 0.5},
        "grpo + kl-to-base": {"start_topk_overlap": 0.1, "ood": 4.0, "id": -0.5},
        "grpo + router-freeze": {"start_topk_overlap": 0.1, "ood": 4.3, "id": -0.2},
        "grpo + rpb": {"start_topk_overlap": 0.1, "ood": 3.0, "flip_rate": 0.05},
        "grpo + R2": {"start_topk_overlap": 0.1, "logp_gap": 0.001},  # +5% of plain's gap
        "gspo": {"id": 1.0},
    }
    got = by_number(judge_rl(cells(shift)))
    assert got == dict.fromkeys(("1.", "2.", "3.", "4.", "4b.", "5.", "6.", "6b.", "7.", "8.", "8b."), "reproduces")


def test_the_opposite_cells_contradict():
    shift = {
        "grpo + R3": {"flip_rate": 0.1, "logp_gap": 0.01, "id": -8.0},
        "grpo + kl-to-base": {"ood": -4.0, "id": -5.0},
        "grpo + router-freeze": {"ood": 4.0, "id": 5.0},
        "grpo + rpb": {"ood": -3.0, "flip_rate": -0.05},
        "grpo + R2": {"logp_gap": 0.01},  # +50% of plain's gap
        "gspo": {"id": 2.0},  # 10 points above R3
        **{a: {"start_topk_overlap": -0.1} for a in ("grpo + lbl",)},
    }
    got = by_number(judge_rl(cells(shift)))
    for claim in ("1.", "2.", "3.", "4.", "4b.", "6.", "6b.", "7.", "8.", "8b."):
        assert got[claim] == "contradicted", claim


def test_a_claim_whose_arms_did_not_run_says_so():
    results = [r for r in cells({}) if r["arm"] in (PLAIN, "grpo + R3")]
    got = by_number(judge_rl(results))
    assert got["4."] == "not run" and got["7."] == "not run" and got["8b."] == "not run"


def test_relative_differences_are_percent_of_the_reference():
    results = [
        {"set": "math_post", "arm": "a", "base": 0, "seed": 1, "retention": {"logp_gap": 0.03}},
        {"set": "math_post", "arm": "b", "base": 0, "seed": 1, "retention": {"logp_gap": 0.02}},
    ]
    assert relative_differences(results, "math_post", "a", "b", "logp_gap") == {0: [pytest.approx(50.0)]}


def test_cost_under_two_points():
    assert cost_under("c", {0: [-1.0, -0.5], 1: [-0.8, -1.2], 2: [-0.9, -1.1]}, 2.0).verdict == "reproduces"
    assert cost_under("c", {0: [-3.0, -3.5], 1: [-3.8, -3.2], 2: [-3.9, -3.1]}, 2.0).verdict == "contradicted"
    assert cost_under("c", {0: [-1.0, -3.5], 1: [-0.8, -3.2], 2: [-1.9, -3.1]}, 2.0).verdict == "inconclusive"


@pytest.mark.parametrize(
    "reward, loss, expected",
    [
        ([0.3, 0.4, 0.5] * 40, [0.1] * 120, False),  # noisy, never below half the best
        ([0.6] * 60 + [0.1] * 60, [0.1] * 120, True),  # falls to a sixth and stays
        ([0.6] * 60 + [0.1] * 5 + [0.6] * 55, [0.1] * 120, False),  # a dip shorter than a tenth of the run
        ([0.4] * 100, [0.1] * 99 + [math.nan], True),  # a non-finite loss
        ([None, 0.5, None, 0.5], [0.1] * 4, False),  # steps without generation are skipped
    ],
)
def test_the_collapse_rule(reward, loss, expected):
    assert collapsed(reward, loss) is expected
