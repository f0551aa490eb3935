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


def test_the_revert_options_parse_and_belong_to_revert_routers_alone(capsys):
    parser = argparse.ArgumentParser(prog="rpb")
    sub = parser.add_subparsers(dest="command", required=True)
    retention.add_commands(sub.add_parser)
    base = ["retention", "--base", "b", "--post", "p", "--data-jsonl", "d", "--out", "o"]
    args = parser.parse_args(base)
    assert (args.revert_routers, args.domain, args.generate, args.reverse, args.shared_expert_gates) == (
        False, None, False, False, False)  # fmt: skip
    args = parser.parse_args([*base, "--revert-routers", "--domain", "m=a", "--domain", "c=b", "--max-new-tokens", "9"])
    assert args.domain == ["m=a", "c=b"] and args.max_new_tokens == 9 and args.revert_routers
    for extra in (["--domain", "m=a"], ["--generate"], ["--reverse", "--shared-expert-gates"]):
        assert main([*base, *extra]) == 2
        err = capsys.readouterr().err
        assert "only with --revert-routers" in err and extra[0] in err
    assert main([*base[:3], *base[5:], "--revert-routers", "--domain", "m=a"]) == 2
    assert "--revert-routers needs --post" in capsys.readouterr().err


def test_rpb_retention_revert_routers_writes_its_report(replica, tmp_path, capsys):
    from rpb.testing import replica as build
    from rpb.testing.data import conversations, write_jsonl

    data = write_jsonl(conversations(4, seed=1), tmp_path / "d.jsonl")
    other = write_jsonl(conversations(3, seed=2), tmp_path / "o.jsonl")
    post = build("deepseek_v3", tmp_path / "post", seed=3)
    code = main(["retention", "--base", str(replica("deepseek_v3")), "--post", str(post), "--data-jsonl", str(data),
                 "--out", str(tmp_path / "out"), "--revert-routers", "--domain", f"math={data}", "--domain",
                 f"other={other}", "--generate", "--max-new-tokens", "3", "--no-progress"])  # fmt: skip
    out = capsys.readouterr().out
    assert code == 0 and "math (trained): answer NLL post" in out and "other: answer NLL post" in out
    assert {p.name for p in (tmp_path / "out").iterdir()} == {"report.json", "report.md", "revert.png"}


def test_every_missing_domain_file_is_named_before_any_model_loads(tmp_path, capsys, monkeypatch):
    import rpb.retention.revert_run as revert_run

    def no_loading(*a, **k):
        raise AssertionError("a model or tokenizer was loaded before the data files were checked")

    monkeypatch.setattr(revert_run, "load_tokenizer", no_loading)
    monkeypatch.setattr(revert_run, "load_pair", no_loading)
    present = tmp_path / "d.jsonl"
    present.write_text("")
    code_file, text_file = tmp_path / "code.jsonl", tmp_path / "text.jsonl"
    code = main(["retention", "--base", "b", "--post", "p", "--data-jsonl", str(tmp_path / "routing.jsonl"),
                 "--out", str(tmp_path / "out"), "--revert-routers", "--domain", f"math={present}",
                 "--domain", f"code={code_file}", "--domain", f"text={text_file}"])  # fmt: skip
    err = capsys.readouterr().err
    assert code == 2
    for line in (f"--domain code={tmp_path / 'code.jsonl'}: no such file",
                 f"--domain text={tmp_path / 'text.jsonl'}: no such file",
                 f"--data-jsonl {tmp_path / 'routing.jsonl'}: no such file"):  # fmt: skip
        assert line in err
    assert f"math={present}" not in err
