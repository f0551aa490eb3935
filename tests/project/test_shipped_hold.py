"""The ``hold`` grid's shipped results (docs/results/hold): every base whole, pinning today's grid on the shipped
base and holding every cell, selection run and retrained ``sft`` cell; and the report is what today's code makes of
the shipped cells, figures byte for byte."""

from __future__ import annotations

import json

from rpb.toyworld.grids.hold import GRID as HOLD_GRID
from rpb.toyworld.grids.hold_report import HOLD_FIGURE
from rpb.toyworld.study.figures import CLAIMS
from tests.project.shipped import ROOT, assert_regenerated, pinned_bases

SHIPPED = ROOT / "docs" / "results" / "hold"
FIGURES = (HOLD_FIGURE, "forest.svg", CLAIMS)


def test_every_base_is_shipped_whole_pins_todays_grid_and_holds_every_cell():
    assert not (SHIPPED / "unfinished").exists()
    for folder, _ in pinned_bases(SHIPPED, HOLD_GRID, every=True):
        cells = list((folder / "runs").glob("*/*/*/result.json"))
        assert len(cells) == len(HOLD_GRID.sets) * len(HOLD_GRID.arms) * len(HOLD_GRID.seeds)
        retrained = list((folder / "revert").glob("*/sft/*/result.json"))
        assert len(retrained) == len(HOLD_GRID.sets) * len(HOLD_GRID.seeds)
        selection = [json.loads(p.read_text()) for p in (folder / "selection").glob("*/result.json")]
        assert len(selection) == sum(len(w) for w in HOLD_GRID.candidates.values())
        chosen = json.loads((folder / "selection.json").read_text())["chosen"]
        assert {m: chosen[m] in w for m, w in HOLD_GRID.candidates.items()} == dict.fromkeys(HOLD_GRID.candidates, True)


def test_the_shipped_tables_are_the_report_of_the_shipped_cells(tmp_path):
    assert_regenerated(SHIPPED, HOLD_GRID, FIGURES, tmp_path)
