"""The ``hold-target`` grid's shipped results (docs/results/hold-target): the bases shipped so far are the grid's
first ones, each whole, pinning today's grid on the shipped base and holding every cell (base 0 its sigmoid
control too); and the report is what today's code makes of the shipped cells, figures byte for byte."""

from __future__ import annotations

import json

from rpb.toyworld.grids.hold_target import GRID
from rpb.toyworld.grids.hold_target_report import LAMBDA_FIGURE, OVERLAP_FIGURE, TRADEOFF_FIGURE
from rpb.toyworld.study.figures import CLAIMS
from tests.project.shipped import ROOT, assert_regenerated, pinned_bases

SHIPPED = ROOT / "docs" / "results" / "hold-target"
FIGURES = (OVERLAP_FIGURE, TRADEOFF_FIGURE, LAMBDA_FIGURE, "forest.svg", CLAIMS)


def test_the_shipped_bases_are_the_grids_first_each_whole_on_its_pinned_base():
    for folder, b in pinned_bases(SHIPPED, GRID):
        cells = [json.loads(p.read_text()) for p in (folder / "runs").glob("*/*/*/result.json")]
        assert len(cells) == len(GRID.sets) * len(GRID.arms) * len(GRID.seeds)
        held = [r for r in cells if (r.get("anchor") or {}).get("target") is not None]
        assert held and all(r["hold"]["lambda"] and None not in r["hold"]["lambda"] for r in held)  # λ per window
        controls = list((folder / "sigmoid").glob("*/*/result.json"))
        assert len(controls) == (len(GRID.sets) * len(GRID.seeds) if b == 0 else 0)


def test_the_shipped_tables_are_the_report_of_the_shipped_cells(tmp_path):
    assert_regenerated(SHIPPED, GRID, FIGURES, tmp_path)
