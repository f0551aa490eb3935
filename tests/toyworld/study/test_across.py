"""A miniature grid on two bases, with the calibrated arm: each base's folder, the report across them
(bases, scores with paired intervals, mechanism, calibrated betas, verdicts), and a rerun that resumes."""

from __future__ import annotations

import json
import shutil
from dataclasses import replace

import pytest

from rpb.toyworld.study.across import cost, run_grid, studies
from rpb.toyworld.study.grid import CALIBRATED, Arm, Grid
from tests.toyworld_mini import MINI_POST

POST = replace(MINI_POST, score_parts=("validation", "test"))
GRID = Grid(
    "mini-bases",
    ("math_post",),
    (Arm("sft", "sft"), Arm("rpb", "rpb"), CALIBRATED),
    (42,),
    tables=("main", "mechanism"),
    bases=(0, 1),
    post=POST,
)


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
    # the figures beside them: each method but sft a row of the forest plot, the claims run judged
    forest, claims = ((root / "out" / f).read_text() for f in ("forest.svg", "claims.svg"))
    assert ">rpb calibrated</text>" in forest and ">rpb</text>" in forest and ">sft</text>" not in forest
    assert "RPB &gt; SFT (math_post, ID)" in claims and "within-soft" not in claims  # not run: left out


def test_a_rerun_reads_every_cell_back(ran):
    root, tables, _ = ran
    messages = []
    assert run_grid(GRID, root / "out", root / "cache", progress=False, announce=messages.append) == tables
    assert "6 done, 0 to run" in messages[0]
    assert cost(GRID, studies(GRID, root / "out", root / "cache")) == messages[0]
    # a grid's own extra cells (the hold grid's retrained cells under revert/) are not runs of the plan
    extra = root / "out" / "base0" / "revert" / "math_post" / "sft" / "seed0" / "result.json"
    extra.parent.mkdir(parents=True)
    try:
        extra.write_text(next((root / "out" / "base0" / "runs").glob("*/*/*/result.json")).read_text())
        assert "6 done, 0 to run" in cost(GRID, studies(GRID, root / "out", root / "cache"))
    finally:
        shutil.rmtree(root / "out" / "base0" / "revert")


def _cell(base, method, seed, id_, ood, **anchor):
    v = {"id": id_, "ood": ood}
    return {
        "set": "math_post",
        "base": base,
        "method": method,
        "arm": method,
        "seed": seed,
        "anchor": anchor,
        "scores": {"validation": v, "test": {"id": 0.0, "ood": 0.0}},
    }


def test_the_beta_rule_regret_against_hand_computed_figures():
    """sft counts as beta 0 and an rpb arm without a beta as beta 1; the criterion is 50 (ID + OOD) on the
    validation part; the regret is the best beta's criterion minus the rule's, seed by seed."""
    from rpb.toyworld.study.across import regret_table

    seeds = (42, 43, 44)
    results = []
    # criterion per seed: sft 39, 40, 41 (mean 40, the best); beta 1: 30; the rule's 0.5: 37, 36, 35, so it
    # trails the best by 2, 4 and 6 points
    for base in (0, 1):
        for seed, sft_id, rule_id in zip(seeds, (0.38, 0.40, 0.42), (0.38, 0.36, 0.34), strict=True):
            results += [
                _cell(base, "sft", seed, sft_id, 0.40),
                _cell(base, "rpb", seed, 0.30, 0.30),
                _cell(base, "rpb", seed, rule_id, 0.36, beta=0.5),
                _cell(base, "lbl", seed, 0.9, 0.9),
            ]
    rows = regret_table(results, {(0, "math_post"): 0.0, (1, "math_post"): 0.5, (2, "math_post"): 0.25})
    lines = rows.splitlines()
    # base 0: the rule's beta is the best: regret 0 on every seed
    assert lines[2] == "| 0 (in-sample) | math_post | 0 | 0, 0.5, 1 | 0 | +0.0 [+0.0, +0.0] | yes |"
    # base 1: 2, 4, 6 -> mean 4; three seeds drawn with replacement: the 2.5% quantile is 2 (1/27 of draws)
    assert lines[3] == "| 1 | math_post | 0.5 | 0, 0.5, 1 | 0 | +4.0 [+2.0, +6.0] | no |"
    assert lines[4] == "| 2 | math_post | 0.25 | — | — | not run | — |"


def test_a_grid_without_sft_pairs_each_beta_with_its_beta_0_arm():
    """The beta grid has no sft arm: its rpb beta=0 arm (sft bit for bit) is the reference, so every other beta
    gets its paired difference; the figures are hand-computed."""
    from rpb.toyworld.study.across import scores_table

    arms = ("rpb beta=0", "rpb beta=1")
    results = []
    # ID: base 0 beta 0 50, 60 and beta 1 40, 44 (-10, -16: mean -13); base 1 30, 30 and 35, 25 (+5, -5: 0);
    # all four pairs: -6.5. OOD 20 everywhere: 0.
    for base, seed, zero, one in ((0, 42, 0.50, 0.40), (0, 43, 0.60, 0.44), (1, 42, 0.30, 0.35), (1, 43, 0.30, 0.25)):
        for label, beta, id_ in ((arms[0], 0.0, zero), (arms[1], 1.0, one)):
            results.append({**_cell(base, "rpb", seed, id_, 0.2, beta=beta), "arm": label, "id": id_, "ood": 0.2})
    table = scores_table(results, "math_post", arms)
    assert "each method minus rpb beta=0 (sft bit for bit) on the same base and seed" in table
    row = next(line for line in table.splitlines() if line.startswith("| rpb beta=1 |")).split(" | ")
    assert row[2].startswith("-6.5 [") and row[3] == "b0 -13.0 / b1 +0.0"
    assert row[5].startswith("+0.0 [+0.0, +0.0]") and "Δ ID vs rpb beta=0 [95% CI]" in table
    assert "Minimal detectable difference against rpb beta=0" in table and "4 pairs" in table
    # with an sft arm, sft stays the reference
    assert "minus sft on the same base" in scores_table(
        [{**r, "arm": "sft"} for r in results[:1]], "math_post", ("sft", *arms)
    )
