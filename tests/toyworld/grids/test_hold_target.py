"""The hold-target grid: its fixed inputs recomputed from the shipped ``hold`` grid (the fixed λ from its
selections, the matched targets from its cells, the margins from its pairs' minimal detectable differences), its
claims judged on hand-made cells, and a cell's λ trajectory read from a hand-written log."""

from __future__ import annotations

import dataclasses
import json
import math
from pathlib import Path

import numpy as np
from scipy.stats import t as student_t

from rpb.toyworld.grids.hold_target import (
    GRID,
    HOLD_LAMBDA,
    ID_MARGIN,
    MATCHED,
    OOD_MARGIN,
    SIGMOID_ARM,
    TARGET_ARMS,
    HoldTargetStudy,
    judge_hold_target,
    trajectory,
)
from rpb.toyworld.study.grid import STUDY_POST

HOLD = Path(__file__).resolve().parents[3] / "docs" / "results" / "hold"


def hold_cells() -> list[dict]:
    return json.loads((HOLD / "results.json").read_text())


def test_the_fixed_lambda_is_the_hold_grids_choice_on_each_base():
    for base, lam in HOLD_LAMBDA.items():
        assert json.loads((HOLD / f"base{base}" / "selection.json").read_text())["chosen"]["routing-kd"] == lam


def test_the_matched_targets_are_the_hold_grids_fixed_lambda_overlaps_to_three_digits():
    cells = [r for r in hold_cells() if r["arm"] == "routing-kd"]
    for (base, post_set), target in MATCHED.items():
        mine = [r["mechanism"]["overlap_base"] for r in cells if r["base"] == base and r["set"] == post_set]
        assert len(mine) == 3 and round(sum(mine) / 3, 3) == target, (base, post_set)


def test_the_margins_are_the_hold_pairs_minimal_detectable_differences_rounded_up():
    """Recomputed here with scipy's t, not the grids' own function: (t_.975 + t_.8) with 8 df x SD / 3."""
    by = {(r["arm"], r["set"], r["base"], r["seed"]): r for r in hold_cells()}
    factor = (student_t.ppf(0.975, 8) + student_t.ppf(0.8, 8)) / 3
    for metric, margins in (("ood", OOD_MARGIN), ("id", ID_MARGIN)):
        for post_set, margin in margins.items():
            d = [
                100 * (by[("routing-kd", s, b, k)][metric] - by[("sft", s, b, k)][metric])
                for (arm, s, b, k) in by
                if arm == "sft" and s == post_set
            ]
            assert len(d) == 9
            assert margin == math.ceil(factor * np.std(d, ddof=1) * 10) / 10, (metric, post_set)


def test_the_grid_is_114_runs_counted_by_hand(tmp_path):
    """6 arms x 2 sets x 3 seeds x 3 bases = 108, and base 0's sigmoid control, 2 sets x 3 seeds."""
    assert [a.label for a in TARGET_ARMS] == [
        "sft", "routing-kd", "target 0.70", "target 0.80", "target 0.90", "target matched",
    ]  # fmt: skip
    assert len(GRID.arms) * len(GRID.sets) * len(GRID.seeds) * len(GRID.bases) == 108
    studies = [
        HoldTargetStudy(tmp_path / f"base{b}", GRID, dataclasses.replace(STUDY_POST, base=dataclasses.replace(
            STUDY_POST.base, seed=b)), base_seed=b)
        for b in GRID.bases
    ]  # fmt: skip
    jobs = {st.base_seed: st.more_jobs(st) for st in studies}
    assert [len(j) for j in jobs.values()] == [6, 0, 0]
    assert dict(SIGMOID_ARM.anchor) == {"target": 0.80, "router_transform": "sigmoid-normalized"}


def test_no_weight_is_chosen_and_each_arm_trains_with_its_own_lambda_or_target(tmp_path, monkeypatch):
    study = HoldTargetStudy(tmp_path, GRID, STUDY_POST)
    assert study.selected_keys() == [] and all(study.selection_key(a) is None for a in TARGET_ARMS)
    seen = {}

    def cell(where, post_set, arm, seed, weight, *args, **kwargs):
        anchor = dict(arm.anchor)
        if arm.method != "sft":
            anchor["lambda_"] = weight
        seen[arm.label] = anchor
        return {}

    monkeypatch.setattr(study, "cell", cell)
    for arm in TARGET_ARMS:
        study.grid_cell("code_post", arm, 42)
    assert seen["routing-kd"] == {"lambda_": 10.0}
    assert seen["target 0.90"] == {"target": 0.9, "lambda_": None}
    assert seen["sft"] == {}
    recorded = {"lambda_": None}
    monkeypatch.setattr(type(study).__mro__[1], "train", lambda self, *a: a[-1])
    assert study.train(tmp_path, "code_post", TARGET_ARMS[-1], 42, recorded)["target"] == 0.941
    assert recorded["target"] == 0.941, "the matched target is in the anchor the cell records"


def cells(shift: dict[str, dict[str, float]], noise: float = 0.5, seed: int = 0) -> list[dict]:
    rng = np.random.default_rng(seed)
    return [
        {
            "arm": arm, "set": "code_post", "base": base, "seed": s,
            "id": 0.7 + shift.get(arm, {}).get("id", 0.0) + noise / 100 * rng.standard_normal(),
            "ood": 0.3 + shift.get(arm, {}).get("ood", 0.0) + noise / 100 * rng.standard_normal(),
        }
        for arm in (a.label for a in TARGET_ARMS) for base in (0, 1, 2) for s in (42, 43, 44)
    ]  # fmt: skip


def by_claim(verdicts, number: str):
    (v,) = [v for v in verdicts if v.claim.startswith(f"({number})")]
    return v


def test_the_claims_read_their_margins_not_zero():
    # matched 5 points below the fixed λ OOD: inside code_post's 10.2-point margin; target 0.70 1 point below sft ID
    held = judge_hold_target(cells({"target 0.90": {"ood": 0.05}, "target matched": {"ood": -0.05},
                                    "target 0.70": {"id": -0.01}}), ("code_post",))  # fmt: skip
    assert [by_claim(held, n).holm for n in "234"] == ["reproduces"] * 3
    # 15 points below: beyond the margin; 0.70 5 points below sft in domain: beyond 2.2
    lost = judge_hold_target(cells({"target matched": {"ood": -0.15}, "target 0.70": {"id": -0.05},
                                    "target 0.90": {"ood": -0.05}}), ("code_post",))  # fmt: skip
    assert [by_claim(lost, n).verdict for n in "234"] == ["contradicted"] * 3


def test_a_cells_trajectory_is_read_window_by_window_from_its_log(tmp_path):
    log = tmp_path / "log.jsonl"
    lines = [
        {"step": 0, "calibrate/displacement": 0.1},
        {"step": 10, "loss": 1.0, "anchor/overlap": 0.95, "anchor/overlap_min": 0.9, "anchor/lambda": 1.0},
        {"step": 20, "loss": 0.9, "anchor/overlap": 0.79, "anchor/overlap_min": 0.7, "anchor/lambda": 1.2},
    ]
    log.write_text("".join(json.dumps(x) + "\n" for x in lines))
    assert trajectory(log) == {
        "step": [10, 20], "overlap": [0.95, 0.79], "overlap_min": [0.9, 0.7], "lambda": [1.0, 1.2],
    }  # fmt: skip
