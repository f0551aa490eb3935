"""A study's report, written from a stand-in study whose inputs are known by hand."""

from __future__ import annotations

import json
from types import SimpleNamespace

from rpb.toyworld.study.grid import CALIBRATED, Arm, Grid
from rpb.toyworld.study.report import write_report
from rpb.toyworld.world.post import PostRecipe


def _result(arm: str, seed: int, id_: float, ood: float) -> dict:
    retention = {"tvd": 0.1, "jsd": 0.05, "topk_overlap": 0.9, "nmi": 0.8}
    return {
        "set": "math_post",
        "arm": arm,
        "seed": seed,
        "id": id_,
        "ood": ood,
        "retention": retention,
        "threads": 1,
        "machine": "m1",
        "torch": "2.0",
    }


def _study(tmp_path, grid: Grid) -> SimpleNamespace:
    return SimpleNamespace(
        grid=grid,
        out=tmp_path,
        post=PostRecipe(),
        trace_set=None,
        base_score=lambda s: {"id": 0.125, "ood": 0.5},
        base_record={"heldout_exact_match": {"math": 0.1234, "facts": 0.5}},
        base_routing=lambda: {"mean": {"entropy_base_bits": 1.23456, "communities_base": 2, "modularity_base": 0.4}},
        calibrated_beta=lambda s: 0.5,
    )


def test_the_report_states_the_studys_inputs(tmp_path):
    grid = Grid(
        "g",
        ("math_post",),
        (Arm("sft", "sft"), Arm("lbl", "lbl"), CALIBRATED),
        (42, 43),
        coefficients={"lbl": 0.01},
        tables=(),
    )
    results = [_result("sft", 43, 0.5, 0.25), _result("lbl", 42, 0.75, 0.5), _result("sft", 42, 0.5, 0.25)]
    assert write_report(_study(tmp_path, grid), results, {"lbl": 0.01}) == ""  # a grid with no tables
    text = (tmp_path / "tables.md").read_text()
    assert text.startswith("# Toy-world study: grid `g`\n\n1 post-training set(s) x 3 arm(s) x 2 seed(s) [42, 43];")
    assert "Anchor weights: lbl 0.01 (fixed)\n" in text
    assert "Calibrated beta (`rpb calibrate`'s rule, rpb/calibrate/rule.py): math_post 0.5 " in text
    assert "Base model held-out exact match % (pretraining's own evaluation): {'math': 12.3, 'facts': 50.0}" in text
    assert "utilization entropy 1.235 bits, 2.0 Louvain communities, modularity 0.400" in text
    assert "3 on m1 at 1 thread with torch 2.0" in text
    written = json.loads((tmp_path / "results.json").read_text())
    assert [(r["arm"], r["seed"]) for r in written] == [("lbl", 42), ("sft", 42), ("sft", 43)]  # by set, arm, seed
    assert (tmp_path / "tradeoff.png").stat().st_size > 0 and (tmp_path / "retention.png").stat().st_size > 0


def test_weights_chosen_on_validation_are_said_so(tmp_path):
    grid = Grid("g", ("math_post",), (Arm("sft", "sft"), Arm("lbl", "lbl")), (42,), tables=())
    write_report(_study(tmp_path, grid), [_result("sft", 42, 0.5, 0.25), _result("lbl", 42, 0.5, 0.25)], {"lbl": 0.01})
    text = (tmp_path / "tables.md").read_text()
    assert "Anchor weights: lbl 0.01 (chosen on the validation split: selection.json)" in text
    assert "Calibrated beta" not in text  # no calibrated arm
