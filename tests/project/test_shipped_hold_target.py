"""The ``hold-target`` grid's shipped results (docs/results/hold-target): the bases shipped so far are the grid's
first ones, each whole, pinning today's grid on the shipped base and holding every cell (base 0 its sigmoid
control too); and the report is what today's code makes of the shipped cells, figures byte for byte."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

from rpb.toyworld.grids.hold_target import GRID
from rpb.toyworld.grids.hold_target_report import LAMBDA_FIGURE, OVERLAP_FIGURE, TRADEOFF_FIGURE
from rpb.toyworld.study.figures import CLAIMS
from rpb.toyworld.study.grid import pinned_fields
from rpb.toyworld.study.shipping import report_shipped, shipped_results, shipped_studies

ROOT = Path(__file__).resolve().parents[2]
SHIPPED = ROOT / "docs" / "results" / "hold-target"
FIGURES = (OVERLAP_FIGURE, TRADEOFF_FIGURE, LAMBDA_FIGURE, "forest.svg", CLAIMS)


def _base_folders() -> list[Path]:
    return sorted(p for p in SHIPPED.glob("base*") if p.is_dir())


def test_the_shipped_bases_are_the_grids_first_each_whole_on_its_pinned_base():
    folders = _base_folders()
    assert folders and [p.name for p in folders] == [f"base{b}" for b in GRID.bases[: len(folders)]]
    shipped_bases = json.loads((ROOT / "bases" / "bases.json").read_text())
    for folder, b in zip(folders, GRID.bases, strict=False):
        pinned = json.loads((folder / "grid.json").read_text())
        assert pinned["grid"] == json.loads(json.dumps(pinned_fields(GRID)))
        assert pinned["base_sha256"] == shipped_bases[f"base{b}"]["weights_sha256"]
        cells = [json.loads(p.read_text()) for p in (folder / "runs").glob("*/*/*/result.json")]
        assert len(cells) == len(GRID.sets) * len(GRID.arms) * len(GRID.seeds)
        held = [r for r in cells if (r.get("anchor") or {}).get("target") is not None]
        assert held and all(r["hold"]["lambda"] and None not in r["hold"]["lambda"] for r in held)  # λ per window
        controls = list((folder / "sigmoid").glob("*/*/result.json"))
        assert len(controls) == (len(GRID.sets) * len(GRID.seeds) if b == 0 else 0)


def test_the_shipped_tables_are_the_report_of_the_shipped_cells(tmp_path):
    out = tmp_path / "hold-target"
    shutil.copytree(SHIPPED, out, ignore=shutil.ignore_patterns("unfinished"))
    for f in FIGURES:  # the report must make them, not find them
        (out / f).unlink()
    sts = shipped_studies(GRID, out)
    assert len([r for st in sts for r in shipped_results(st)]) == len(sts) * len(GRID.sets) * len(GRID.arms) * len(
        GRID.seeds
    )
    tables = report_shipped(GRID, out)
    assert tables == (SHIPPED / "tables.md").read_text()
    for f in ("results.json", "bases.json"):
        assert json.loads((out / f).read_text()) == json.loads((SHIPPED / f).read_text())
    for f in FIGURES:
        assert (out / f).read_bytes() == (SHIPPED / f).read_bytes(), f
