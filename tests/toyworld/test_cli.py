"""The toy world's commands reach ``rpb`` through the ``rpb.commands`` entry point, with their options."""

import argparse
from importlib.metadata import entry_points

import pytest

from rpb.cli import build_parser
from rpb.toyworld import cli
from rpb.toyworld.grids import GRIDS


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


def test_every_grid_choice_is_a_grid():
    parser = argparse.ArgumentParser(prog="rpb")
    sub = parser.add_subparsers(dest="command", required=True)
    cli.add_commands(sub.add_parser)
    assert set(sub.choices) == {"demo", "experiment"}
    grid = next(a for a in sub.choices["experiment"]._actions if a.dest == "grid")
    assert set(grid.choices) <= set(cli.experiment_grids()) and grid.default in grid.choices
    assert set(cli.experiment_grids()) == {*GRIDS, "beta-frequency", "rl", "revert"}
    assert "beta-frequency" in grid.choices and "rl" in grid.choices


def test_ship_and_resume_from_exclude_each_other(capsys):
    with pytest.raises(SystemExit):
        build_parser().parse_args(["experiment", "--ship", "a", "--resume-from", "b"])
    assert "not allowed with argument" in capsys.readouterr().err
