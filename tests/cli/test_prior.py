"""The prior's command family on its own parser: its commands, and the refusals of their argument types."""

import argparse

import pytest

from rpb.cli import main, prior


def test_the_family_registers_the_prior_commands_and_only_them():
    parser = argparse.ArgumentParser(prog="rpb")
    sub = parser.add_subparsers(dest="command", required=True)
    prior.add_commands(sub.add_parser)
    assert set(sub.choices) == {"collect", "validate", "calibrate", "render", "routes"}
    args = parser.parse_args(["render", "--tokenizer", "t", "--in", "a.jsonl", "--out", "b.jsonl"])
    assert (args.input, args.out, args.trust_remote_code) == ("a.jsonl", "b.jsonl", False)
    args = parser.parse_args(["collect", "--model", "m", "--data-jsonl", "d", "--out-path", "o", "--max-seq-len", "8",
                              "--from-routes", "r.safetensors"])  # fmt: skip
    assert (args.from_routes, args.top_k, args.prior_kind) == ("r.safetensors", None, None)
    assert args.fused_shared_experts == 0


def test_calibrate_default_betas_and_a_bad_list(capsys):
    parser = argparse.ArgumentParser(prog="rpb")
    sub = parser.add_subparsers(dest="command", required=True)
    prior.add_commands(sub.add_parser)
    args = parser.parse_args(["calibrate", "--model", "m", "--prior", "p", "--data-jsonl", "d", "--out", "o"])
    assert args.betas == [0.1, 0.25, 0.5, 1.0, 2.0] and args.rows is None
    with pytest.raises(SystemExit) as exit_:
        main(["calibrate", "--model", "m", "--prior", "p", "--data-jsonl", "d", "--out", "o", "--betas", "a,b"])
    assert exit_.value.code == 2 and "comma-separated list of numbers" in capsys.readouterr().err


def test_validate_refuses_template_kwargs_that_are_not_an_object(tmp_path, capsys):
    with pytest.raises(SystemExit) as exit_:
        main(["validate", str(tmp_path / "p.safetensors"), "--chat-template-kwargs", "true"])
    assert exit_.value.code == 2 and "expected a JSON object, got bool" in capsys.readouterr().err
