"""A miniature grid on two bases, with the calibrated arm: each base's folder, the report across them
(bases, scores with paired intervals, mechanism, calibrated betas, verdicts), and a rerun that resumes."""

from __future__ import annotations

import json
from dataclasses import replace

import pytest

from rpb.toyworld.across import cost, run_grid, studies
from rpb.toyworld.experiment import CALIBRATED, Arm, Grid
from tests.toyworld_mini import MINI_POST

POST = replace(MINI_POST, score_parts=("validation", "test"))
GRID = Grid("mini-bases", ("math_post",), (Arm("sft", "sft"), Arm("rpb", "rpb"), CALIBRATED), (42,),
            tables=("main", "mechanism"), bases=(0, 1), post=POST)  # fmt: skip


@pytest.fixture(scope="module")
def ran(tmp_path_factory):
    root = tmp_path_factory.mktemp("bases")
    messages = []
    tables = run_grid(GRID, root / "out", root / "cache", progress=False, announce=messages.append)
    return root, tables, messages


def test_each_base_has_its_folder_and_every_cell_both_parts(ran):
    root, _, messages = ran
    results = json.loads((root / "out" / "results.json").read_text())
    assert sorted((r["base"], r["arm"]) for r in results) == [
        (b, a) for b in (0, 1) for a in sorted(("sft", "rpb", "rpb calibrated"))
    ]
    for r in results:
        assert set(r["scores"]) == {"validation", "test"} and r["id"] == r["scores"]["test"]["id"]
        assert r["scores"]["validation"]["part"] == "validation"
        m = r["mechanism"]
        assert 0 <= m["overlap_base"] <= 1 and 0 <= m["overlap_prior"] <= 1
        assert (m["start_displacement"] is None) == (r["method"] == "sft")
    for b in (0, 1):
        cal = json.loads((root / "out" / f"base{b}" / "calibration" / "math_post" / "calibrate.json").read_text())
        used = next(r for r in results if r["base"] == b and r["arm"] == "rpb calibrated")
        assert used["anchor"]["beta"] == cal["recommended_beta"] and cal["betas"] == [0.25, 0.5, 1.0, 2.0, 4.0]
    bases = [json.loads((root / "out" / f"base{b}" / "base_facts.json").read_text()) for b in (0, 1)]
    assert bases[0]["weights_sha256"] != bases[1]["weights_sha256"] and bases[1]["seed"] == 1
    assert "0 done, 6 to run" in messages[0]


def test_the_report_across_bases(ran):
    root, tables, _ = ran
    assert tables == (root / "out" / "tables.md").read_text()
    headings = [
        "### The bases",
        "### math_post: exact match",
        "Minimal detectable difference",
        "### math_post: what the training did",
        "### Calibrated beta",
        "### The paper's claims",
    ]
    assert all(h in tables for h in headings)
    assert "| RPB > SFT (math_post, ID) |" in tables and "| within-soft ≈ RPB (math_post, ID) | — |" in tables
    assert "b0 " in tables and "b1 " in tables  # each base's own difference


def test_a_rerun_reads_every_cell_back(ran):
    root, tables, _ = ran
    messages = []
    assert run_grid(GRID, root / "out", root / "cache", progress=False, announce=messages.append) == tables
    assert "6 done, 0 to run" in messages[0]
    assert cost(GRID, studies(GRID, root / "out", root / "cache")) == messages[0]
