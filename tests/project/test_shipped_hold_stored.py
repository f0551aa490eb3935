"""The ``hold-stored`` grid's shipped results (docs/results/hold-stored): the bases shipped so far are the grid's
first ones, each whole, pinning today's grid on the shipped base; its copied cells are the source grids' files byte
for byte, its new weighted cells carry their windows; and the report is what today's code makes of the shipped
cells, figures byte for byte."""

from __future__ import annotations

import json

from rpb.toyworld.grids.hold_report import HOLD_FIGURE
from rpb.toyworld.grids.hold_stored import GRID, STORED_ARMS
from rpb.toyworld.study.figures import CLAIMS
from tests.project.shipped import ROOT, assert_regenerated, pinned_bases

SHIPPED = ROOT / "docs" / "results" / "hold-stored"
FIGURES = (HOLD_FIGURE, "forest.svg", CLAIMS)


def test_the_shipped_bases_are_the_grids_first_each_whole_with_its_copies_byte_for_byte():
    for folder, _ in pinned_bases(SHIPPED, GRID):
        chosen = json.loads((folder / "selection.json").read_text())["chosen"]
        hold_choice = json.loads((ROOT / "docs/results/hold" / folder.name / "selection.json").read_text())["chosen"]
        for arm in STORED_ARMS:
            cells = sorted((folder / "runs").glob(f"*/{arm.slug}/*/result.json"))
            assert len(cells) == len(GRID.sets) * len(GRID.seeds), arm.label
            copied = arm.source is not None and (
                arm.selection is None or chosen[arm.selection] == hold_choice[arm.selection]
            )
            for cell in cells:
                if copied:
                    source = ROOT / "docs/results" / arm.source / cell.relative_to(folder.parent)
                    assert cell.read_bytes() == source.read_bytes(), cell
                elif arm.method != "sft":
                    assert json.loads(cell.read_text())["windows"]["anchor_loss"], cell


def test_the_shipped_tables_are_the_report_of_the_shipped_cells(tmp_path):
    assert_regenerated(SHIPPED, GRID, FIGURES, tmp_path)
