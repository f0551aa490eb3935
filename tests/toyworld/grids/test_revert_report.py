"""The ``revert`` grid's report over the miniature study's cells: its tables read the cells' own figures, the cells
are set beside the shipped cells they repeat, the claim's verdicts are the judge's, and the figures are drawn."""

from __future__ import annotations

import json

import pytest

from rpb.toyworld.grids.revert import REVERT_FIGURE, judge_revert, report_revert, shipped_cell
from tests.toyworld.grids.test_revert import SHIPPED


def test_the_report_reads_the_cells_figures(revert_finished, tmp_path):
    study, results = revert_finished
    tables = report_revert(study.grid, [study], results, tmp_path)
    assert (tmp_path / "tables.md").read_text() == tables
    sft = results[0]["revert"]["base"]["math_post"]
    x = sft["delta_nll"]  # one cell: the two-stage bootstrap's interval is the cell itself
    assert f"| sft | math_post (trained) | {x:+.4f} [{x:+.4f}, {x:+.4f}] |" in tables
    kl = results[1]["revert"]["base"]["facts"]
    post, back = kl["variants"]["post"]["topk_overlap"], kl["variants"]["post+base routers"]["topk_overlap"]
    assert f"| kl-to-base | facts | {kl['delta_nll']:+.4f}" in tables and f"{post:.3f} → {back:.3f}" in tables
    for v in judge_revert(results):
        row = next(line for line in tables.splitlines() if line.startswith(f"| {v.claim} |"))
        assert f"| {v.verdict} |" in row and v.verdict in ("reproduces", "contradicted", "inconclusive")
    written = json.loads((tmp_path / "results.json").read_text())
    assert [r["arm"] for r in written] == sorted(r["arm"] for r in results) and all("rl" not in r for r in written)
    assert (tmp_path / REVERT_FIGURE).read_text().startswith("<?xml") and (tmp_path / "claims.svg").is_file()


def test_a_retrained_cell_is_set_beside_the_shipped_cell_it_repeats():
    cell = {"arm": "grpo + R3", "base": 1, "set": "math_post", "seed": 44}
    want = SHIPPED / "rl" / "base1" / "runs" / "math_post" / "grpo+R3" / "seed44" / "result.json"
    assert shipped_cell(cell) == json.loads(want.read_text())
    full = shipped_cell({"arm": "kl-to-base", "base": 2, "set": "math_post", "seed": 42})
    assert (full["arm"], full["base"], full["seed"]) == ("kl-to-base", 2, 42)
    assert shipped_cell({"arm": "sft", "base": 7, "set": "math_post", "seed": 42}) is None
    with pytest.raises(KeyError):
        shipped_cell({"arm": "lbl", "base": 0, "set": "math_post", "seed": 42})
