"""The training command family on its own parser: train, experts and audit, and the choices they refuse."""

import argparse

import pytest

from rpb.cli import training


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="rpb")
    sub = p.add_subparsers(dest="command", required=True)
    training.add_commands(sub.add_parser)
    return p


def test_the_family_registers_the_training_commands_and_only_them():
    sub = next(a for a in parser()._actions if isinstance(a, argparse._SubParsersAction))
    assert set(sub.choices) == {"train", "experts", "audit"}


def test_train_takes_dry_run_and_overrides():
    args = parser().parse_args(["train", "--config", "run.yaml", "--dry-run", "anchor.beta=0.5"])
    assert (args.config, args.dry_run, args.overrides, args.func) == (
        "run.yaml",
        True,
        ["anchor.beta=0.5"],
        training._train,
    )
    assert parser().parse_args(["train", "--config", "run.yaml"]).dry_run is False


def test_experts_defaults_and_threshold_excludes_top_n(capsys):
    args = parser().parse_args(["experts", "--prior", "p", "--out", "e.json"])
    assert (args.measure, args.span, args.threshold, args.top_n, args.batch_size) == ("gate", "all", None, None, 8)
    with pytest.raises(SystemExit):
        parser().parse_args(["experts", "--prior", "p", "--out", "e.json", "--threshold", "0.2", "--top-n", "3"])
    assert "not allowed with argument" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        parser().parse_args(["experts", "--prior", "p", "--out", "e.json", "--measure", "weight"])


def test_audit_needs_a_config_and_takes_four_rows_by_default():
    args = parser().parse_args(["audit", "--config", "run.yaml", "train.seed=1"])
    assert (args.rows, args.report, args.overrides) == (4, None, ["train.seed=1"])
    with pytest.raises(SystemExit):
        parser().parse_args(["audit"])
