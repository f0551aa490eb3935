"""Shipping a grid's finished bases (rpb.toyworld.study.shipping), on a run folder made of the shipped headline
grid's base 0 (a finished base: 40 cells, 3 selection runs, its facts, scores and calibration) with what a
real run folder holds besides (data, priors, checkpoints, retention folders), none of which may travel."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from rpb.cli import main
from rpb.toyworld.grids import grids
from rpb.toyworld.study.across import studies
from rpb.toyworld.study.cells import GridChangedError, cell_paths
from rpb.toyworld.study.shipping import NotFinishedError, resume_from, ship, ship_base, shipped_studies

GRIDS = grids()

ROOT = Path(__file__).resolve().parents[3]
HEADLINE = ROOT / "docs" / "results" / "headline"
GRID = GRIDS["headline"]
#: what a finished base of the headline grid holds, counted by hand: grid.json, selection.json, base_facts.json,
#: 2 base scores, 2 x 2 calibration files, 3 selection runs (lbl's three weights), 2 sets x 4 arms x 5 seeds
FILES = 3 + 2 + 4 + 3 + 40


def _run_folder(tmp_path) -> Path:
    run = tmp_path / "run"
    shutil.copytree(HEADLINE / "base0", run / "base0")
    extra = (
        "priors/math_post.safetensors",
        "data/math_post.train.jsonl",
        "base_routing/report.json",
        "runs/math_post/sft/seed42/model/model.safetensors",
        "runs/math_post/sft/seed42/retention/report.json",
        "selection/lbl-0.01/model/config.json",
    )
    for junk in extra:
        (run / "base0" / junk).parent.mkdir(parents=True, exist_ok=True)
        (run / "base0" / junk).write_text("not for the repository")
    return run


def _files(folder: Path) -> dict[str, bytes]:
    return {str(p.relative_to(folder)): p.read_bytes() for p in folder.rglob("*") if p.is_file()}


def test_a_finished_base_ships_its_result_files_and_nothing_else(tmp_path):
    run, dest = _run_folder(tmp_path), tmp_path / "dest"
    said = ship(GRID, run, dest)
    assert _files(dest / "base0") == _files(HEADLINE / "base0") and len(_files(dest / "base0")) == FILES
    assert "base 0: 52 files" in said
    assert "base 1: not shipped" in said and "not started" in said and not (dest / "base1").exists()
    # the report over the one base shipped: its title says so, and its results are that base's 40 cells
    assert (dest / "tables.md").read_text().startswith("# Toy-world study: grid `headline` on bases [0]")
    cells = sorted(
        (json.loads(p.read_text()) for p in (HEADLINE / "base0" / "runs").glob("*/*/*/result.json")),
        key=lambda r: (r["set"], r["arm"], r["seed"]),
    )
    assert json.loads((dest / "results.json").read_text()) == cells and len(cells) == 40
    assert list(json.loads((dest / "bases.json").read_text())) == ["0"]
    assert [st.base_seed for st in shipped_studies(GRID, dest)] == [0]
    # and its figures beside the tables, the one base's (the whole grid's are in docs/results/headline)
    forest = (dest / "forest.svg").read_text()
    assert "rpb calibrated" in forest and forest != (HEADLINE / "forest.svg").read_text()
    assert "Grid `headline`: the paper" in (dest / "claims.svg").read_text()


def test_rpb_experiment_ship_trains_nothing_and_ships_again_the_same(tmp_path, capsys):
    run, dest = _run_folder(tmp_path), tmp_path / "dest"
    said = ship(GRID, run, dest)
    capsys.readouterr()
    assert main(["experiment", "--grid", "headline", "--out", str(run), "--ship", str(dest)]) == 0
    assert capsys.readouterr().out.strip() == said
    assert _files(dest / "base0") == _files(HEADLINE / "base0")
    # nothing was made in the run folder: what it held before, the three folders _run_folder added
    assert {p.name for p in (run / "base0").iterdir()} == {p.name for p in (HEADLINE / "base0").iterdir()} | {
        "base_routing",
        "data",
        "priors",
    }


def test_a_base_with_unfinished_runs_is_refused_with_every_one_named(tmp_path):
    run = _run_folder(tmp_path)
    for cell in ("runs/math_post/sft/seed43", "runs/code_post/rpbcalibrated/seed46", "selection/lbl-0.1"):
        (run / "base0" / cell / "result.json").unlink()
    (st,) = [s for s in shipped_studies(GRID, run)]
    with pytest.raises(NotFinishedError) as caught:
        ship_base(st, tmp_path / "dest")
    message = str(caught.value)
    assert "3 of 43 runs not finished" in message
    assert all(c in message for c in ("runs/math_post/sft/seed43", "rpbcalibrated/seed46", "selection/lbl-0.1"))
    assert not (tmp_path / "dest").exists()


def test_a_destination_pinning_another_set_up_is_refused(tmp_path):
    run, dest = _run_folder(tmp_path), tmp_path / "dest"
    (dest / "base0").mkdir(parents=True)
    other = json.loads((run / "base0" / "grid.json").read_text())
    other["base_sha256"] = "0" * 64
    (dest / "base0" / "grid.json").write_text(json.dumps(other))
    (st,) = shipped_studies(GRID, run)
    with pytest.raises(GridChangedError, match="pins another set-up"):
        ship_base(st, dest)
    assert sorted(p.name for p in (dest / "base0").iterdir()) == ["grid.json"]


def test_a_one_base_grid_is_not_shipped_this_way(tmp_path):
    with pytest.raises(ValueError, match="runs on one base"):
        ship(GRIDS["demo"], tmp_path / "run", tmp_path / "dest")


def test_a_base_still_running_keeps_its_finished_runs_aside_until_it_ships_whole(tmp_path):
    run, dest = _run_folder(tmp_path), tmp_path / "dest"
    unfinished = ("runs/math_post/sft/seed43", "runs/code_post/rpbcalibrated/seed46", "selection/lbl-0.1")
    held = {c: (run / "base0" / c / "result.json").read_bytes() for c in unfinished}
    for cell in unfinished:
        (run / "base0" / cell / "result.json").unlink()
    said = ship(GRID, run, dest)
    kept = dest / "unfinished" / "base0"
    assert "base 0: not shipped" in said and "base 0: 40 finished runs kept in" in said and "no report" in said
    assert not (dest / "base0").exists() and not (dest / "tables.md").exists()
    # its pinned set-up and its 40 finished runs (43 less the 3 unfinished: 38 cells, 2 selection runs), byte
    # for byte, and nothing else: no scores, calibration, facts, data, priors or checkpoints
    finished = {
        k: v
        for k, v in _files(HEADLINE / "base0").items()
        if k.endswith("result.json") and not k.startswith(unfinished)
    }
    assert _files(kept) == {"grid.json": (HEADLINE / "base0" / "grid.json").read_bytes(), **finished}
    assert len(finished) == 40
    # two more runs finish: the kept folder grows; the last one: the base ships whole, the kept folder goes
    for cell in unfinished[:2]:
        (run / "base0" / cell / "result.json").write_bytes(held[cell])
    assert "42 finished runs kept" in ship(GRID, run, dest)
    assert "base 1: not shipped" in ship(GRID, run, dest) and "not started" in ship(GRID, run, dest)
    (run / "base0" / unfinished[2] / "result.json").write_bytes(held[unfinished[2]])
    assert "base 0: 52 files" in ship(GRID, run, dest)
    assert _files(dest / "base0") == _files(HEADLINE / "base0") and not (dest / "unfinished").exists()
    # a base shipped from another run folder (another machine) is said to be so, not "not started"
    shutil.rmtree(run / "base0")
    assert f"base 0: shipped already in {dest / 'base0'}, not run in {run}" in ship(GRID, run, dest)


def _shipped_with_one_base_running(tmp_path) -> tuple[Path, list[str]]:
    """docs/results/headline as it stood with base 0 whole and base 1 under way: 3 of base 1's runs unfinished"""
    dest = tmp_path / "shipped"
    shutil.copytree(HEADLINE / "base0", dest / "base0")
    shutil.copytree(HEADLINE / "base1", dest / "unfinished" / "base1")
    unfinished = ["runs/math_post/lbl/seed42", "runs/code_post/rpb/seed45", "selection/lbl-0.001"]
    kept = dest / "unfinished" / "base1"
    for path in [p for p in kept.rglob("*") if p.is_file()]:
        if path.name not in ("result.json", "grid.json") or str(path.parent.relative_to(kept)) in unfinished:
            path.unlink()
    return dest, unfinished


def test_resume_from_puts_every_shipped_run_back_and_leaves_the_unfinished_to_run(tmp_path):
    dest, unfinished = _shipped_with_one_base_running(tmp_path)
    run = tmp_path / "run"
    said = resume_from(GRID, run, dest)
    assert said.splitlines()[0].startswith("base 0: 43 finished runs from") and "(52 files)" in said
    assert said.splitlines()[1].startswith("base 1: 40 finished runs from") and "(41 files)" in said
    assert len(said.splitlines()) == 2  # base 2: nothing shipped, nothing made
    assert _files(run / "base0") == _files(HEADLINE / "base0") and not (run / "base2").exists()
    (base1,) = [st for st in studies(GRID, run, progress=False) if st.base_seed == 1]
    missing = sorted(str(p.parent.relative_to(run / "base1")) for p in cell_paths(base1) if not p.is_file())
    assert missing == sorted(unfinished)
    for p in cell_paths(base1):  # a run put back is the shipped one, byte for byte
        if p.is_file():
            assert p.read_bytes() == (HEADLINE / "base1" / p.relative_to(run / "base1")).read_bytes()


def test_resume_from_never_writes_over_the_run_folder(tmp_path):
    dest, _ = _shipped_with_one_base_running(tmp_path)
    run = tmp_path / "run"
    mine = run / "base1" / "runs" / "math_post" / "sft" / "seed42" / "result.json"
    mine.parent.mkdir(parents=True)
    mine.write_text('{"this run folder": "its own result"}')
    resume_from(GRID, run, dest)
    assert mine.read_text() == '{"this run folder": "its own result"}'
    # a run folder pinning another set-up: refused before any file is copied, for every base
    other = tmp_path / "other"
    (other / "base1").mkdir(parents=True)
    pinned = json.loads((HEADLINE / "base1" / "grid.json").read_text())
    pinned["base_sha256"] = "0" * 64
    (other / "base1" / "grid.json").write_text(json.dumps(pinned))
    with pytest.raises(GridChangedError, match="pins another set-up"):
        resume_from(GRID, other, dest)
    assert [str(p.relative_to(other)) for p in other.rglob("*") if p.is_file()] == ["base1/grid.json"]


def test_ship_and_resume_from_are_not_given_together(tmp_path, capsys):
    with pytest.raises(SystemExit):
        main(["experiment", "--grid", "beta", "--out", str(tmp_path), "--ship", "a", "--resume-from", "b"])
    assert "not allowed with argument" in capsys.readouterr().err


def test_rpb_experiment_resume_from_puts_the_runs_back_before_the_grid_runs(tmp_path, capsys, monkeypatch):
    import rpb.toyworld.study.across as across

    dest, _ = _shipped_with_one_base_running(tmp_path)
    run, seen = tmp_path / "run", {}

    def run_grid(grid, out, *args, **kwargs):  # the grid itself is not run here: what it would find is recorded
        seen["grid"], seen["found"] = grid.name, sorted(p for p in Path(out).rglob("result.json"))
        return "tables"

    monkeypatch.setattr(across, "run_grid", run_grid)
    argv = ["experiment", "--grid", "headline", "--out", str(run), "--resume-from", str(dest), "--lanes", "1"]
    assert main(argv) == 0
    out = capsys.readouterr().out
    assert out.startswith("base 0: 43 finished runs from") and "base 1: 40 finished runs from" in out
    assert seen["grid"] == "headline" and len(seen["found"]) == 43 + 40


def test_rpb_experiment_bases_runs_only_that_share_of_the_grid_and_writes_no_report(tmp_path, capsys, monkeypatch):
    from rpb.toyworld.study.cells import Study

    ran = []
    monkeypatch.setattr(Study, "run", lambda self: ran.append((self.base_seed, self.out)) or [{"cell": 1}])
    argv = ["experiment", "--grid", "full", "--out", str(tmp_path), "--bases", "2", "--lanes", "1"]
    assert main(argv) == 0
    out = capsys.readouterr().out
    # the share runs in the folder the whole grid would use, so that --ship takes it as it takes any base
    assert ran == [(2, tmp_path / "base2")]
    assert "1 base(s) x" in out and "ran base(s) [2] of grid 'full' (1 cells)" in out
    assert "no report" in out and "wrote" not in out and not (tmp_path / "tables.md").exists()
    assert main([*argv[:-4], "--bases", "3", "--lanes", "1"]) == 2
    assert "grid 'full' has bases [0, 1, 2]: no base [3]" in capsys.readouterr().err
