"""The headline study's shipped results (docs/results/headline): its tables.md is what today's code makes
from its shipped cells, and each base's pinned set-up is today's ``headline`` grid on the shipped base
(bases/bases.json) that it ran on.

So the figures in docs/toyworld.md are the report's own and not typed in; a change to the grid, the
statistics or the tables that would alter them fails here until the results are rerun or regenerated.
No base is rebuilt: the report reads each base's facts and calibration from the shipped files.
"""

from __future__ import annotations

import hashlib
import json
import shutil
from dataclasses import asdict
from pathlib import Path

import pytest

from rpb.toyworld.across import report_across, studies
from rpb.toyworld.experiment import GRIDS

ROOT = Path(__file__).resolve().parents[2]
SHIPPED = ROOT / "docs" / "results" / "headline"
GRID = GRIDS["headline"]


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
    """Each base folder pins today's grid and the shipped base's sha256; every cell in it is one of the grid's
    (or of its weight selection), on that base, with its machine and threads."""
    pins = json.loads((ROOT / "bases" / "bases.json").read_text())
    assert sorted(p.name for p in SHIPPED.glob("base*") if p.is_dir()) == [f"base{b}" for b in GRID.bases]
    cells = {(s, a.slug, f"seed{seed}") for s in GRID.sets for a in GRID.arms for seed in GRID.seeds}
    for b in GRID.bases:
        folder = SHIPPED / f"base{b}"
        pinned = json.loads((folder / "grid.json").read_text())
        assert pinned["grid"] == json.loads(json.dumps(asdict(GRID))) and pinned["post_recipe"]["base"]["seed"] == b
        facts = json.loads((folder / "base_facts.json").read_text())
        assert pinned["base_sha256"] == facts["weights_sha256"] == pins[f"base{b}"]["weights_sha256"]
        found = list((folder / "runs").glob("*/*/*/result.json"))
        assert {tuple(p.relative_to(folder / "runs").parts[:3]) for p in found} == cells and len(found) == 40
        for path in found:
            cell = json.loads(path.read_text())
            assert cell["base"] == b and cell["machine"] and cell["threads"] >= 1
        for path in (folder / "selection").glob("*/result.json"):
            assert json.loads(path.read_text())["part"] == "validation"


def test_the_shipped_tables_are_the_report_of_the_shipped_cells(tmp_path):
    out = tmp_path / "headline"
    shutil.copytree(SHIPPED, out)
    sts = studies(GRID, out, progress=False)
    results = [r for st in sts for r in _cells(st)]
    assert len(results) == len(GRID.bases) * len(GRID.sets) * len(GRID.arms) * len(GRID.seeds) == 120
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
