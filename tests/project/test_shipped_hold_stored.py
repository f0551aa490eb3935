"""The ``hold-stored`` grid's shipped results (docs/results/hold-stored): the bases shipped so far are the grid's
first ones, each whole, pinning today's grid on the shipped base; its copied cells are the source grids' files byte
for byte, its new weighted cells carry their windows; and the report is what today's code makes of the shipped
cells, figures byte for byte."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

from rpb.toyworld.grids.hold_report import HOLD_FIGURE
from rpb.toyworld.grids.hold_stored import GRID, STORED_ARMS
from rpb.toyworld.study.figures import CLAIMS
from rpb.toyworld.study.grid import pinned_fields
from rpb.toyworld.study.shipping import report_shipped, shipped_results, shipped_studies

ROOT = Path(__file__).resolve().parents[2]
SHIPPED = ROOT / "docs" / "results" / "hold-stored"
FIGURES = (HOLD_FIGURE, "forest.svg", CLAIMS)


def _base_folders() -> list[Path]:
    return sorted(p for p in SHIPPED.glob("base*") if p.is_dir())


def test_the_shipped_bases_are_the_grids_first_each_whole_with_its_copies_byte_for_byte():
    folders = _base_folders()
    assert folders and [p.name for p in folders] == [f"base{b}" for b in GRID.bases[: len(folders)]]
    shipped_bases = json.loads((ROOT / "bases" / "bases.json").read_text())
    for folder, b in zip(folders, GRID.bases, strict=False):
        pinned = json.loads((folder / "grid.json").read_text())
        assert pinned["grid"] == json.loads(json.dumps(pinned_fields(GRID)))
        assert pinned["base_sha256"] == shipped_bases[f"base{b}"]["weights_sha256"]
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
    out = tmp_path / "hold-stored"
    shutil.copytree(SHIPPED, out, ignore=shutil.ignore_patterns("unfinished"))
    for f in FIGURES:  # the report must make them, not find them
        (out / f).unlink()
    sts = shipped_studies(GRID, out)
    cells = len(GRID.sets) * len(GRID.arms) * len(GRID.seeds)
    assert len([r for st in sts for r in shipped_results(st)]) == len(sts) * cells
    tables = report_shipped(GRID, out)
    assert tables == (SHIPPED / "tables.md").read_text()
    for f in ("results.json", "bases.json"):
        assert json.loads((out / f).read_text()) == json.loads((SHIPPED / f).read_text())
    for f in FIGURES:
        assert (out / f).read_bytes() == (SHIPPED / f).read_bytes(), f
