"""What every shipped grid's test checks, once: the shipped bases are the grid's first ones, each pinning today's
grid on the shipped base's weights; and the shipped report is what today's code makes of the shipped cells, tables,
records and figures byte for byte."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

from rpb.toyworld.study.grid import pinned_fields
from rpb.toyworld.study.shipping import report_shipped, shipped_results, shipped_studies

ROOT = Path(__file__).resolve().parents[2]


def pinned_bases(shipped: Path, grid, every: bool = False) -> list[tuple[Path, int]]:
    """Each shipped base folder with its base seed: the grid's first bases (``every``: all of them), each pinning
    today's grid and the shipped base's weights."""
    folders = sorted(p for p in shipped.glob("base*") if p.is_dir())
    wanted = grid.bases if every else grid.bases[: len(folders)]
    assert folders and [p.name for p in folders] == [f"base{b}" for b in wanted]
    shipped_bases = json.loads((ROOT / "bases" / "bases.json").read_text())
    for folder, b in zip(folders, grid.bases, strict=False):
        pinned = json.loads((folder / "grid.json").read_text())
        assert pinned["grid"] == json.loads(json.dumps(pinned_fields(grid))), folder
        assert pinned["base_sha256"] == shipped_bases[f"base{b}"]["weights_sha256"], folder
    return list(zip(folders, grid.bases, strict=False))


def assert_regenerated(shipped: Path, grid, figures: tuple[str, ...], tmp_path: Path) -> None:
    """The report made anew from a copy of the shipped cells (its figures deleted first, so it must make them) is
    the shipped one; every shipped base holds every cell of the grid."""
    out = tmp_path / shipped.name
    shutil.copytree(shipped, out, ignore=shutil.ignore_patterns("unfinished"))
    for f in figures:
        (out / f).unlink()
    sts = shipped_studies(grid, out)
    cells = len(grid.sets) * len(grid.arms) * len(grid.seeds)
    assert len([r for st in sts for r in shipped_results(st)]) == len(sts) * cells
    tables = report_shipped(grid, out)
    assert tables == (shipped / "tables.md").read_text()
    for f in ("results.json", "bases.json"):
        assert json.loads((out / f).read_text()) == json.loads((shipped / f).read_text()), f
    for f in figures:
        assert (out / f).read_bytes() == (shipped / f).read_bytes(), f
