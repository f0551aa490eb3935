"""The toy world's commands reach ``rpb`` through the ``rpb.commands`` entry point, with their options."""

import argparse
import subprocess
import sys
from importlib.metadata import entry_points

import pytest

from rpb.cli import build_parser
from rpb.toyworld import cli
from rpb.toyworld.grids import grids

GRIDS = grids()


def test_the_entry_point_loads_this_module():
    loaded = {ep.load() for ep in entry_points(group="rpb.commands") if ep.name == "toyworld"}
    assert loaded == {cli.add_commands}


def test_rpb_gets_demo_and_experiment_with_their_arguments():
    parser = build_parser()
    assert parser.plugin_failures == []
    args = parser.parse_args(["demo", "--lanes", "2", "--from-scratch"])
    assert (args.out, args.lanes, args.from_scratch, args.func) == ("rpb-demo", 2, True, cli._demo)
    args = parser.parse_args(["experiment", "--grid", "cot", "--bases", "0", "2", "--ship", "shipped"])
    assert (args.grid, args.bases, args.ship, args.resume_from, args.out) == ("cot", [0, 2], "shipped", None, None)


def test_the_grid_option_names_every_grid_in_its_help():
    parser = argparse.ArgumentParser(prog="rpb")
    sub = parser.add_subparsers(dest="command", required=True)
    cli.add_commands(sub.add_parser)
    assert set(sub.choices) == {"demo", "experiment"}
    grid = next(a for a in sub.choices["experiment"]._actions if a.dest == "grid")
    assert grid.default in GRIDS and grid.choices is None  # module:ATTR too
    shown = "".join(sub.choices["experiment"].format_help().split())  # argparse wraps lines, hyphens too
    assert all("".join(f"{name}: {g.about}".split()) in shown for name, g in GRIDS.items())


def test_the_command_line_is_built_without_the_toy_worlds_grids():
    """Listing the grids imports the whole toy world (seconds): it waits for ``rpb experiment --help``, so that
    ``rpb collect`` and the other core commands start without it."""
    check = (
        "import sys\n"
        "from rpb.cli import build_parser\n"
        "assert build_parser().plugin_failures == []\n"
        "loaded = sorted(m for m in sys.modules if m.startswith(('rpb.toyworld.study', 'rpb.toyworld.world')))\n"
        "assert loaded == [], loaded\n"
    )
    done = subprocess.run([sys.executable, "-c", check], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-2000:]


#: a grid of one's own, in a module of a package outside rpb: one arm, one seed, the miniature study's recipe
THROWAWAY = """
from rpb.toyworld.study.grid import Grid, arms
from tests.toyworld_mini import MINI_POST

TINY = Grid("tiny", ("math_post",), arms("sft"), (42,), coefficients={}, tables=("main",), post=MINI_POST,
            about="one sft cell")
"""


def test_a_grid_from_a_module_of_ones_own_runs_through_the_command_line(tmp_path, monkeypatch, capsys):
    """``rpb experiment --grid package.module:ATTR``: the grid is imported from a temporary package and its
    miniature runs to its tables, one cell in its pinned folder."""
    import json
    import sys

    from rpb.cli import main

    package = tmp_path / "mine"
    package.mkdir()
    (package / "__init__.py").write_text("")
    (package / "tiny_grid.py").write_text(THROWAWAY)
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.delitem(sys.modules, "mine", raising=False)
    out = tmp_path / "run"
    argv = ["experiment", "--grid", "mine.tiny_grid:TINY", "--out", str(out), "--cache-dir", str(tmp_path / "cache")]
    assert main([*argv, "--no-progress", "--lanes", "1"]) == 0
    printed = capsys.readouterr().out
    assert "grid tiny: 1 base(s) x (1 set(s) x 1 arm(s) x 1 seed(s) + 0 weight-selection run(s)) = 1 runs" in printed
    cell = json.loads((out / "runs" / "math_post" / "sft" / "seed42" / "result.json").read_text())
    assert (cell["arm"], cell["method"], cell["seed"]) == ("sft", "sft", 42)
    assert json.loads((out / "grid.json").read_text())["grid"]["name"] == "tiny"
    tables = (out / "tables.md").read_text()
    assert tables.startswith("# Toy-world study: grid `tiny`") and "| sft | " in tables


def test_ship_and_resume_from_exclude_each_other(capsys):
    with pytest.raises(SystemExit):
        build_parser().parse_args(["experiment", "--ship", "a", "--resume-from", "b"])
    assert "not allowed with argument" in capsys.readouterr().err
