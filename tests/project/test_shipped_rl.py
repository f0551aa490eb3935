"""The ``rl`` grid's shipped results (docs/results/rl): every base whole, pinning today's grid on the shipped base;
each cell started from its base's recorded start; the starts are the ``full`` grid's seed-42 ``sft`` cells
(within 2 points, bit for bit on the same machine type and threads); and the report is what today's code makes
of the shipped cells, figures byte for byte."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from rpb.anchors import get_method
from rpb.toyworld.grids.rl import GRID as RL_GRID
from rpb.toyworld.study.figures import CLAIMS
from rpb.toyworld.study.grid import pinned_fields
from rpb.toyworld.study.rl_figures import RL_FIGURE
from rpb.toyworld.study.shipping import report_shipped, shipped_results, shipped_studies
from tests.project.test_prose_figures import claim_rows, flat

ROOT = Path(__file__).resolve().parents[2]
RESULTS = ROOT / "docs" / "results"
SHIPPED = RESULTS / "rl"


def _base_folders() -> list[Path]:
    return sorted(p for p in SHIPPED.glob("base*") if p.is_dir())


def test_every_base_is_shipped_whole_and_pins_todays_grid():
    assert [p.name for p in _base_folders()] == [f"base{b}" for b in RL_GRID.bases]
    assert not (SHIPPED / "unfinished").exists()
    shipped_bases = json.loads((ROOT / "bases" / "bases.json").read_text())
    weighted = {a.method for a in RL_GRID.arms if get_method(a.method).coefficient}
    for folder, b in zip(_base_folders(), RL_GRID.bases, strict=True):
        pinned = json.loads((folder / "grid.json").read_text())
        assert pinned["grid"] == json.loads(json.dumps(pinned_fields(RL_GRID)))
        assert pinned["post_recipe"]["base"]["seed"] == b
        assert pinned["base_sha256"] == shipped_bases[f"base{b}"]["weights_sha256"]
        start = json.loads((folder / "start" / "record.json").read_text())
        cells = list((folder / "runs").glob("*/*/*/result.json"))
        assert len(cells) == len(RL_GRID.arms) * len(RL_GRID.seeds)
        for path in cells:
            cell = json.loads(path.read_text())
            assert (cell["base"], cell["start_sha256"]) == (b, start["weights_sha256"])
            assert cell["rl"]["settings"]["router_aux_loss_coef"] == 0.0
            assert len(cell["rl"]["reward"]) == RL_GRID.recipe.max_steps and cell["threads"] >= 1
        selection = [json.loads(p.read_text()) for p in (folder / "selection").glob("*/result.json")]
        assert len(selection) == sum(len(RL_GRID.candidates[m]) for m in weighted)
        assert all(s["part"] == "validation" and s["seed"] == RL_GRID.seeds[0] for s in selection)


@pytest.mark.parametrize("b", RL_GRID.bases)
def test_each_start_is_the_full_grids_sft_cell(b):
    """The precision of issue 51: the retrained start reproduces the shipped seed-42 scores within ±2 points on
    the same machine type; at the same thread count there it is the same cell, every figure equal."""
    start = json.loads((SHIPPED / f"base{b}" / "start" / "record.json").read_text())
    cell = RESULTS / "full" / f"base{b}" / "runs" / "math_post" / "sft" / "seed42" / "result.json"
    full = json.loads(cell.read_text())
    assert (start["set"], start["method"], start["seed"]) == (full["set"], full["method"], full["seed"])
    if start["machine"] != full["machine"]:
        pytest.skip(f"base {b}: the full grid's cell ran on {full['machine']}, the start on {start['machine']}")
    for part in ("validation", "test"):
        for metric in ("id", "ood"):
            assert abs(100 * (start["scores"][part][metric] - full["scores"][part][metric])) <= 2.0, (part, metric)
    if start["threads"] == full["threads"]:
        assert start["scores"] == full["scores"]


def test_the_shipped_tables_are_the_report_of_the_shipped_cells(tmp_path):
    out = tmp_path / "rl"
    shutil.copytree(SHIPPED, out)
    for f in (RL_FIGURE, CLAIMS):  # the report must make them, not find them
        (out / f).unlink()
    sts = shipped_studies(RL_GRID, out)
    results = [r for st in sts for r in shipped_results(st)]
    assert len(results) == len(RL_GRID.bases) * len(RL_GRID.arms) * len(RL_GRID.seeds)
    tables = report_shipped(RL_GRID, out)
    assert tables == (SHIPPED / "tables.md").read_text()
    for f in ("results.json", "bases.json"):
        assert json.loads((out / f).read_text()) == json.loads((SHIPPED / f).read_text())
    for f in (RL_FIGURE, CLAIMS):
        assert (out / f).read_bytes() == (SHIPPED / f).read_bytes(), f


def test_the_results_page_shows_the_figure_and_rl_md_quotes_every_verdict():
    """The grid's results page (tables.md, in the docs' navigation) shows rl.svg; docs/rl.md states each claim's
    verdict by rule and after Holm's adjustment, as the report computes them."""
    tables = (SHIPPED / "tables.md").read_text()
    assert f"]({RL_FIGURE})" in tables and (SHIPPED / RL_FIGURE).is_file()
    assert "results/rl/tables.md" in (ROOT / "mkdocs.yml").read_text()
    claims = claim_rows(tables)
    quoted = flat((ROOT / "docs" / "rl.md").read_text())
    for row in claims:
        claim = row["claim (fixed before the grid ran, with its margin)"]
        number = claim.split(".")[0] + "".join(f" ({m})" for m in ("ID", "OOD") if f"({m}," in claim)
        said = f"claim {number}: {row['verdict']} by rule, {row['Holm-adjusted']} after Holm"
        assert flat(said) in quoted, said
