"""The headline study's shipped results (docs/results/headline): its tables.md is what today's code makes
from its shipped cells, and each base's pinned set-up is the grid they ran (``SHIPPED_HEADLINE``: three
seeds on the bases before bases/; ``GRIDS["headline"]`` now asks for five on the shipped bases, and its cells
replace these when all 120 are done).

So the figures in docs/toyworld.md are the report's own and not typed in; a change to the grid, the
statistics or the tables that would alter them fails here until the results are rerun or regenerated.
No base is rebuilt: the report reads each base's facts and calibration from the shipped files.
"""

from __future__ import annotations

import hashlib
import json
import shutil
from dataclasses import asdict, replace
from pathlib import Path

import pytest

from rpb.toyworld.across import report_across, studies
from rpb.toyworld.experiment import GRIDS, SHIPPED_HEADLINE

ROOT = Path(__file__).resolve().parents[2]
SHIPPED = ROOT / "docs" / "results" / "headline"
GRID = SHIPPED_HEADLINE


def _cells(st) -> list[dict]:
    """A base's finished cells in the grid's order (as ``Study.run`` returns them)."""
    out = []
    for s in GRID.sets:
        for arm in GRID.arms:
            for seed in GRID.seeds:
                path = st.out / "runs" / s / arm.slug / f"seed{seed}" / "result.json"
                out.append(json.loads(path.read_text()))
    return out


def test_each_base_pins_todays_headline_grid():
    assert GRIDS["headline"] == replace(GRID, seeds=GRIDS["headline"].seeds, post=GRIDS["headline"].post)
    assert len(GRIDS["headline"].seeds) == 5  # the grid under way: only its seeds and kernels differ
    for b in GRID.bases:
        pinned = json.loads((SHIPPED / f"base{b}" / "grid.json").read_text())
        assert pinned["grid"] == json.loads(json.dumps(asdict(GRID)))
        facts = json.loads((SHIPPED / f"base{b}" / "base_facts.json").read_text())
        assert pinned["base_sha256"] == facts["weights_sha256"] and facts["seed"] == b


def test_the_shipped_tables_are_the_report_of_the_shipped_cells(tmp_path):
    out = tmp_path / "headline"
    shutil.copytree(SHIPPED, out)
    sts = studies(GRID, out, progress=False)
    results = [r for st in sts for r in _cells(st)]
    assert len(results) == len(GRID.bases) * len(GRID.sets) * len(GRID.arms) * len(GRID.seeds) == 72
    assert {(r["base"], r["set"], r["arm"], r["seed"]) for r in results} == {
        (b, s, a.label, seed) for b in GRID.bases for s in GRID.sets for a in GRID.arms for seed in GRID.seeds
    }
    tables = report_across(GRID, sts, results, out)
    assert tables == (SHIPPED / "tables.md").read_text()
    assert json.loads((out / "results.json").read_text()) == json.loads((SHIPPED / "results.json").read_text())


@pytest.mark.parametrize("base", GRID.bases)
def test_the_calibrated_arm_used_its_bases_rule(base):
    rule = hashlib.sha256((ROOT / "src" / "rpb" / "calibrate" / "rule.py").read_bytes()).hexdigest()
    for s in GRID.sets:
        cal = json.loads((SHIPPED / f"base{base}" / "calibration" / s / "calibrate.json").read_text())
        assert cal["rule"]["source_sha256"] == rule  # the rule committed before bases 1 and 2, unchanged
        for seed in GRID.seeds:
            cell = SHIPPED / f"base{base}" / "runs" / s / "rpbcalibrated" / f"seed{seed}" / "result.json"
            assert json.loads(cell.read_text())["anchor"]["beta"] == cal["recommended_beta"]


# ---- the five-seed headline grid, under way (docs/results/headline-next) --------------------------------

NEXT = ROOT / "docs" / "results" / "headline-next"


def test_the_cells_of_the_grid_under_way_are_todays_grid_on_the_shipped_bases():
    """Each base folder shipped so far pins today's ``headline`` grid and the shipped base's sha256; every cell
    in it is one of the grid's (or of its weight selection), on that base, with its machine and threads."""
    grid, pins = GRIDS["headline"], json.loads((ROOT / "bases" / "bases.json").read_text())
    folders = sorted(NEXT.glob("base*"))
    assert folders, "no base folder shipped yet"
    cells = {(s, a.slug, f"seed{seed}") for s in grid.sets for a in grid.arms for seed in grid.seeds}
    for folder in folders:
        b = int(folder.name.removeprefix("base"))
        pinned = json.loads((folder / "grid.json").read_text())
        assert pinned["grid"] == json.loads(json.dumps(asdict(grid))) and b in grid.bases
        assert pinned["post_recipe"]["base"]["seed"] == b
        assert pinned["base_sha256"] == pins[f"base{b}"]["weights_sha256"]
        for path in (folder / "runs").glob("*/*/*/result.json"):
            cell = json.loads(path.read_text())
            assert tuple(path.relative_to(folder / "runs").parts[:3]) in cells
            assert cell["base"] == b and cell["machine"] and cell["threads"] >= 1
        for path in (folder / "selection").glob("*/result.json"):
            assert json.loads(path.read_text())["part"] == "validation"
