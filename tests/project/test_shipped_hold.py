"""The ``hold`` grid's shipped results (docs/results/hold): every base whole, pinning today's grid on the shipped
base and holding every cell, selection run and retrained ``sft`` cell; and the report is what today's code makes of
the shipped cells, figures byte for byte."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

from rpb.toyworld.grids.hold import GRID as HOLD_GRID
from rpb.toyworld.grids.hold_report import HOLD_FIGURE
from rpb.toyworld.study.figures import CLAIMS
from rpb.toyworld.study.grid import pinned_fields
from rpb.toyworld.study.shipping import report_shipped, shipped_results, shipped_studies

ROOT = Path(__file__).resolve().parents[2]
SHIPPED = ROOT / "docs" / "results" / "hold"
FIGURES = (HOLD_FIGURE, "forest.svg", CLAIMS)


def _base_folders() -> list[Path]:
    return sorted(p for p in SHIPPED.glob("base*") if p.is_dir())


def test_every_base_is_shipped_whole_pins_todays_grid_and_holds_every_cell():
    folders = _base_folders()
    assert [p.name for p in folders] == [f"base{b}" for b in HOLD_GRID.bases]
    assert not (SHIPPED / "unfinished").exists()
    shipped_bases = json.loads((ROOT / "bases" / "bases.json").read_text())
    for folder, b in zip(folders, HOLD_GRID.bases, strict=True):
        pinned = json.loads((folder / "grid.json").read_text())
        assert pinned["grid"] == json.loads(json.dumps(pinned_fields(HOLD_GRID)))
        assert pinned["base_sha256"] == shipped_bases[f"base{b}"]["weights_sha256"]
        cells = list((folder / "runs").glob("*/*/*/result.json"))
        assert len(cells) == len(HOLD_GRID.sets) * len(HOLD_GRID.arms) * len(HOLD_GRID.seeds)
        retrained = list((folder / "revert").glob("*/sft/*/result.json"))
        assert len(retrained) == len(HOLD_GRID.sets) * len(HOLD_GRID.seeds)
        selection = [json.loads(p.read_text()) for p in (folder / "selection").glob("*/result.json")]
        assert len(selection) == sum(len(w) for w in HOLD_GRID.candidates.values())
        chosen = json.loads((folder / "selection.json").read_text())["chosen"]
        assert {m: chosen[m] in w for m, w in HOLD_GRID.candidates.items()} == dict.fromkeys(HOLD_GRID.candidates, True)


def test_the_shipped_tables_are_the_report_of_the_shipped_cells(tmp_path):
    out = tmp_path / "hold"
    shutil.copytree(SHIPPED, out, ignore=shutil.ignore_patterns("unfinished"))
    for f in FIGURES:  # the report must make them, not find them
        (out / f).unlink()
    sts = shipped_studies(HOLD_GRID, out)
    assert len([r for st in sts for r in shipped_results(st)]) == len(sts) * len(HOLD_GRID.sets) * len(
        HOLD_GRID.arms
    ) * len(HOLD_GRID.seeds)
    tables = report_shipped(HOLD_GRID, out)
    assert tables == (SHIPPED / "tables.md").read_text()
    for f in ("results.json", "bases.json"):
        assert json.loads((out / f).read_text()) == json.loads((SHIPPED / f).read_text())
    for f in FIGURES:
        assert (out / f).read_bytes() == (SHIPPED / f).read_bytes(), f
