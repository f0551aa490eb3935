"""``rpb retention`` on its own parser: its defaults, and what it refuses."""

import argparse

import pytest

from rpb.cli import main, retention


def test_retention_defaults_and_its_optional_measures():
    parser = argparse.ArgumentParser(prog="rpb")
    sub = parser.add_subparsers(dest="command", required=True)
    retention.add_commands(sub.add_parser)
    assert set(sub.choices) == {"retention"}
    args = parser.parse_args(["retention", "--base", "b", "--data-jsonl", "d", "--out", "o"])
    assert (args.post, args.max_rows, args.seed, args.resolution, args.max_seq_len) == (None, None, 0, 1.0, 2048)
    assert (args.transitions, args.steps_by, args.chat_template_kwargs, args.dtype) == (False, None, None, "float32")
    args = parser.parse_args(["retention", "--base", "b", "--data-jsonl", "d", "--out", "o", "--steps-by", r"\n"])
    assert args.steps_by == r"\n"


def test_retention_refuses_template_kwargs_that_are_not_json(capsys):
    with pytest.raises(SystemExit) as exit_:
        main(["retention", "--base", "b", "--data-jsonl", "d", "--out", "o", "--chat-template-kwargs", "{x}"])
    assert exit_.value.code == 2 and "not JSON" in capsys.readouterr().err
