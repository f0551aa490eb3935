"""The study's shipped results (docs/results/<grid>): each tables.md is what today's code makes from its
shipped cells, and each base's pinned set-up is today's grid on the shipped base (bases/bases.json) that it
ran on.

So the figures in docs/toyworld.md, and forest.svg and claims.svg beside each tables.md, are the report's own
and not typed in; a change to the grids, the statistics, the tables or the figures' drawing that would alter
them fails here until the results are rerun or regenerated.
No base is rebuilt: the report reads each base's facts and calibration from the shipped files.
A grid under way ships base by base (rpb experiment --ship); its report covers the bases shipped so far.
"""

from __future__ import annotations

import hashlib
import json
import shutil
from dataclasses import asdict
from pathlib import Path

import pytest

from rpb.anchors import AnchorConfig, get_method
from rpb.toyworld.grids import grids
from rpb.toyworld.study.figures import CLAIMS, FOREST
from rpb.toyworld.study.grid import pinned_fields
from rpb.toyworld.study.shipping import report_shipped, shipped_results, shipped_studies

GRIDS = grids()

ROOT = Path(__file__).resolve().parents[2]
RESULTS = ROOT / "docs" / "results"
#: the study's grids on the three bases, and those still being run (issue 33): a grid not listed here must
#: have every base shipped
STUDY_GRIDS = ("headline", "beta", "full")
UNDER_WAY: set[str] = set()  # every study grid is whole (issue 33)
#: the grids with a base shipped whole (a grid may have only a base under way, in unfinished/)
SHIPPED = [g for g in STUDY_GRIDS if any(p.is_dir() for p in (RESULTS / g).glob("base*"))]
#: the figures the report draws beside tables.md (rpb.toyworld.study.figures)
FIGURES = (FOREST, CLAIMS)
RULE = hashlib.sha256((ROOT / "src" / "rpb" / "calibrate" / "rule.py").read_bytes()).hexdigest()


def _bases(name: str) -> list[int]:
    return sorted(int(p.name.removeprefix("base")) for p in (RESULTS / name).glob("base*") if p.is_dir())


def test_every_finished_grid_is_shipped_whole():
    assert "headline" in SHIPPED
    for name in STUDY_GRIDS:
        if name not in UNDER_WAY:
            assert _bases(name) == list(GRIDS[name].bases), name
        elif name in SHIPPED:  # shipped in the grid's order, base by base
            assert _bases(name) == list(GRIDS[name].bases[: len(_bases(name))]), name


def _pins_todays_grid(folder: Path, grid, b: int) -> dict:
    """The base folder's grid.json: today's grid on the shipped base b (bases/bases.json's sha256)."""
    pinned = json.loads((folder / "grid.json").read_text())
    assert pinned["grid"] == json.loads(json.dumps(pinned_fields(grid))) and pinned["post_recipe"]["base"]["seed"] == b
    assert (
        pinned["base_sha256"] == json.loads((ROOT / "bases" / "bases.json").read_text())[f"base{b}"]["weights_sha256"]
    )
    return pinned


def _cells_on(folder: Path, b: int) -> list[Path]:
    """The folder's cells, each run on base b, with its machine and threads."""
    found = list((folder / "runs").glob("*/*/*/result.json"))
    for path in found:
        cell = json.loads(path.read_text())
        assert cell["base"] == b and cell["machine"] and cell["threads"] >= 1
    return found


@pytest.mark.parametrize("name", STUDY_GRIDS)
def test_a_base_under_way_keeps_only_finished_runs_of_todays_grid(name):
    """docs/results/<grid>/unfinished/base<seed>/ (rpb experiment --ship of a base still running): a base of the
    grid not shipped whole yet, pinning today's grid on the shipped base, holding its grid.json and finished
    runs of that grid alone (each cell's own record says the same set, arm and seed as its folder)."""
    grid = GRIDS[name]
    kept = sorted(p for p in (RESULTS / name / "unfinished").glob("*") if p.is_dir())
    if name not in UNDER_WAY:
        assert not kept, "a grid shipped whole keeps no unfinished base"
    for folder in kept:
        b = int(folder.name.removeprefix("base"))
        assert folder.name == f"base{b}" and b in grid.bases and b not in _bases(name)
        _pins_todays_grid(folder, grid, b)
        arms = {a.slug: a.label for a in grid.arms}
        for path in _cells_on(folder, b):
            s, slug, seed = path.relative_to(folder / "runs").parts[:3]
            cell = json.loads(path.read_text())
            assert (cell["set"], cell["arm"], f"seed{cell['seed']}") == (s, arms[slug], seed)
            assert s in grid.sets and cell["seed"] in grid.seeds
        runs = {p.relative_to(folder) for p in folder.rglob("*") if p.is_file()}
        assert all(p.name == "result.json" and p.parts[0] in ("runs", "selection") for p in runs - {Path("grid.json")})


@pytest.mark.parametrize("name", SHIPPED)
def test_each_base_pins_todays_grid(name):
    """Each base folder pins today's grid and the shipped base's sha256; it holds every cell of the grid (and
    of its weight selection), each on that base, with its machine and threads."""
    grid = GRIDS[name]
    cells = {(s, a.slug, f"seed{seed}") for s in grid.sets for a in grid.arms for seed in grid.seeds}
    for b in _bases(name):
        folder = RESULTS / name / f"base{b}"
        pinned = _pins_todays_grid(folder, grid, b)
        facts = json.loads((folder / "base_facts.json").read_text())
        assert pinned["base_sha256"] == facts["weights_sha256"]
        found = _cells_on(folder, b)
        assert {tuple(p.relative_to(folder / "runs").parts[:3]) for p in found} == cells
        assert len(found) == len(grid.sets) * len(grid.arms) * len(grid.seeds)
        selection = list((folder / "selection").glob("*/result.json"))
        if grid.coefficients is None:
            weighted = {a.method for a in grid.arms if get_method(a.method).coefficient}
            assert len(selection) == sum(len(grid.candidates[m]) for m in weighted)
        assert all(json.loads(p.read_text())["part"] == "validation" for p in selection)
        if grid.judges_beta_rule or any(a.calibrated for a in grid.arms):
            for s in grid.sets:  # the rule committed before bases 1 and 2, unchanged
                assert json.loads((folder / "calibration" / s / "calibrate.json").read_text())["rule"][
                    "source_sha256"] == RULE  # fmt: skip


@pytest.mark.parametrize("name", SHIPPED)
def test_the_shipped_tables_are_the_report_of_the_shipped_cells(name, tmp_path):
    grid, out = GRIDS[name], tmp_path / name
    shutil.copytree(RESULTS / name, out)
    for f in FIGURES:  # the report must make them, not find them
        (out / f).unlink()
    sts = shipped_studies(grid, out)
    results = [r for st in sts for r in shipped_results(st)]
    assert len(results) == len(_bases(name)) * len(grid.sets) * len(grid.arms) * len(grid.seeds)
    assert {(r["base"], r["set"], r["arm"], r["seed"]) for r in results} == {
        (b, s, a.label, seed) for b in _bases(name) for s in grid.sets for a in grid.arms for seed in grid.seeds
    }
    tables = report_shipped(grid, out)
    assert tables.startswith(f"# Toy-world study: grid `{name}` on bases {_bases(name)}")
    assert tables == (RESULTS / name / "tables.md").read_text()
    for f in ("results.json", "bases.json"):
        assert json.loads((out / f).read_text()) == json.loads((RESULTS / name / f).read_text())
    for f in FIGURES:  # the shipped figures are the report's render of the shipped cells, byte for byte
        assert (out / f).read_bytes() == (RESULTS / name / f).read_bytes(), f


def test_the_headline_grid_has_its_120_cells():
    assert len(json.loads((RESULTS / "headline" / "results.json").read_text())) == 120


@pytest.mark.parametrize("base", GRIDS["headline"].bases)
def test_the_calibrated_arm_used_its_bases_rule(base):
    grid = GRIDS["headline"]
    for s in grid.sets:
        cal = json.loads((RESULTS / "headline" / f"base{base}" / "calibration" / s / "calibrate.json").read_text())
        for seed in grid.seeds:
            cell = RESULTS / "headline" / f"base{base}" / "runs" / s / "rpbcalibrated" / f"seed{seed}" / "result.json"
            assert json.loads(cell.read_text())["anchor"]["beta"] == cal["recommended_beta"]


def _same_training(cell: dict, post_recipe: dict) -> str:
    """What a cell's training depends on besides the machine: the post-training recipe (the base's seed in it),
    the set, the seed, the method and its effective anchor. ``rpb`` at beta 0 adds no bias and trains as
    ``sft`` does; ``sft`` reads no anchor setting."""
    method = cell["method"]
    anchor = {k: v for k, v in {**asdict(AnchorConfig()), **cell["anchor"]}.items() if k != "method"}
    if method == "rpb" and anchor["beta"] == 0:
        method = "sft"
    key = {"post": post_recipe, "set": cell["set"], "seed": cell["seed"], "method": method,
           "anchor": {} if method == "sft" else anchor}  # fmt: skip
    return json.dumps(key, sort_keys=True)


def _figures(cell: dict) -> dict[str, float]:
    flat = {"id": cell["id"], "ood": cell["ood"], **{f"retention {k}": v for k, v in cell["retention"].items()}}
    for part, scores in cell["scores"].items():
        flat |= {f"{part} {d}": v for d, v in scores["per_domain"].items()}
    return flat


def test_a_cell_run_twice_on_one_machine_type_scores_the_same_in_every_grid():
    """The same training (recipe, base, set, seed, method and effective anchor) on the same machine type and
    thread count gives the same figures, whichever grid ran it, on whichever day and torch build (2.11 and
    2.13 on Intel Xeon). Across machine types the kernels' summation order differs and the seeds' paths part:
    that is why each cell records its machine, and no figure is compared across them here."""
    groups: dict[tuple, list[tuple[str, dict]]] = {}
    for name in STUDY_GRIDS:
        for folder in [*(RESULTS / name).glob("base[0-9]"), *(RESULTS / name / "unfinished").glob("base[0-9]")]:
            post = json.loads((folder / "grid.json").read_text())["post_recipe"]
            for path in (folder / "runs").glob("*/*/*/result.json"):
                cell = json.loads(path.read_text())
                key = (_same_training(cell, post), cell["machine"], cell["threads"])
                groups.setdefault(key, []).append((str(path.relative_to(RESULTS)), _figures(cell)))
    twice = [cells for cells in groups.values() if len(cells) > 1]
    # base 0 on AMD EPYC (full's sft and rpb against beta's beta 0 and beta 1), base 2 on Intel Xeon (full's
    # first cells, run under torch 2.11, against the headline grid's, under 2.13)
    assert len(twice) >= 12
    for cells in twice:
        (first, figures), *others = cells
        for where, other in others:
            assert other.keys() == figures.keys(), (first, where)
            off = {k: (figures[k], other[k]) for k in figures if abs(figures[k] - other[k]) > 1e-9}
            assert not off, f"{first} and {where}: {off}"
