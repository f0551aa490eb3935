"""The demo's shipped cells (docs/results/demo, from ``rpb demo`` on the shipped base 0): its tables.md is what
today's code makes of them, and the README's demo table is that table. Nothing is trained: the report reads
the shipped cells, base scores, base routing and calibration."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

from rpb.toyworld.grids.demo import GRID as DEMO
from rpb.toyworld.study.cells import Study
from rpb.toyworld.world.post import PostRecipe

ROOT = Path(__file__).resolve().parents[2]
SHIPPED = ROOT / "docs" / "results" / "demo"


def test_the_readme_demo_table_is_the_report_of_the_shipped_cells(tmp_path):
    out = tmp_path / "demo"
    shutil.copytree(SHIPPED, out)
    grid = DEMO
    study = Study(out, grid, grid.post or PostRecipe(), tmp_path / "cache", progress=False)
    results = [
        json.loads((out / "runs" / s / a.slug / f"seed{seed}" / "result.json").read_text())
        for s in grid.sets
        for a in grid.arms
        for seed in grid.seeds
    ]
    assert len(results) == 4 and {r["arm"] for r in results} == {a.label for a in grid.arms}
    tables = study.report(results)
    assert (out / "tables.md").read_text() == (SHIPPED / "tables.md").read_text()
    pinned = json.loads((SHIPPED / "grid.json").read_text())
    assert pinned["base_sha256"] == json.loads((ROOT / "bases" / "bases.json").read_text())["base0"]["weights_sha256"]
    lines = tables.splitlines()
    start = next(i for i, line in enumerate(lines) if line.startswith("| method |"))
    end = next((i for i in range(start, len(lines)) if not lines[i].startswith("|")), len(lines))
    rows = [line for line in lines[start:end] if "---" not in line]  # the first table
    readme = (ROOT / "README.md").read_text()
    assert len(rows) == 6 and all(row in readme for row in rows)  # header, base, four arms
