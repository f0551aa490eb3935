"""The README's quickstart, every command of it, end to end on a tiny local model and data.

The commands are read from the README (the shell block after the ``<!-- quickstart`` marker), so
the README cannot drift from what works. Two things differ from a real run, and only these: the
model id, in the commands and in the shipped YAML, names a tiny Moonlight-shaped checkpoint saved
locally (top-6 of 16 experts, as the quickstart's ``--top-k 6`` needs), and the full training run
is cut to two steps of batch 4 without TensorBoard (the configuration is otherwise the shipped
YAML, dry run included).
"""

from __future__ import annotations

import json
import re
import shlex
from pathlib import Path

import pytest

from rpb.cli import main
from rpb.testing.data import conversations, write_jsonl
from rpb.testing.models import build_tiny_model

ROOT = Path(__file__).resolve().parents[2]
MODEL_ID = "moonshotai/Moonlight-16B-A3B"
SHORT_RUN = ["train.max_steps=2", "train.batch_size=4", "train.grad_accum=1", "train.report_to=[none]"]


def quickstart_commands() -> list[str]:
    text = (ROOT / "README.md").read_text()
    block = re.search(r"<!-- quickstart.*?-->\n```bash\n(.*?)^```", text, flags=re.S | re.M).group(1)
    lines = [line.split(" #")[0].strip() for line in block.replace("\\\n", " ").splitlines()]
    return [" ".join(line.split()) for line in lines if line and not line.startswith("#")]


def test_the_quickstart_is_what_the_readme_says():
    cmds = quickstart_commands()
    assert [c.split()[1] for c in cmds] == ["collect", "validate", "calibrate", "train", "train", "retention"]
    assert all(c.startswith("rpb ") for c in cmds)


def test_every_quickstart_command_runs(tmp_path, monkeypatch, moon_tok, capsys):
    model_dir = tmp_path / "Moonlight-tiny"
    build_tiny_model("moonlight", len(moon_tok), seed=0, n_routed_experts=16, num_experts_per_tok=6).save_pretrained(
        model_dir
    )
    moon_tok.save_pretrained(model_dir)
    workdir = tmp_path / "work"
    write_jsonl(conversations(12, seed=2), workdir / "data" / "train.jsonl")
    for yaml in (ROOT / "examples" / "hf").glob("*.yaml"):  # the shipped configs, naming the tiny model
        (workdir / "examples" / "hf").mkdir(parents=True, exist_ok=True)
        (workdir / "examples" / "hf" / yaml.name).write_text(yaml.read_text().replace(MODEL_ID, str(model_dir)))
    monkeypatch.chdir(workdir)
    for command in quickstart_commands():
        argv = shlex.split(command.replace(MODEL_ID, str(model_dir)))[1:]
        if argv[0] == "train" and "--dry-run" not in argv:
            argv += SHORT_RUN
        assert main(argv) == 0, (command, capsys.readouterr().err[-2000:])
    out = capsys.readouterr().out
    assert "OK" in out and "configuration OK (anchor.method=rpb)" in out
    run = json.loads((workdir / "runs" / "moonlight-rpb" / "rpb_run.json").read_text())
    assert run["method"] == "rpb" and run["config"]["anchor"]["beta"] == 1.0
    assert json.loads((workdir / "calibration" / "calibrate.json").read_text())["recommended_beta"] >= 0
    report = json.loads((workdir / "retention" / "report.json").read_text())
    assert report["post"] == "runs/moonlight-rpb" and 0 <= report["mean"]["tvd"] <= 1


@pytest.mark.parametrize("path", sorted((ROOT / "examples").rglob("*.yaml")), ids=lambda p: p.name)
def test_every_shipped_config_loads_and_validates(path, tmp_path, monkeypatch):
    """Without downloading anything: the files a config names are stood in for by empty files."""
    from rpb.integrations.megatron.config import load_megatron_config
    from rpb.train.config import load_config

    monkeypatch.chdir(tmp_path)
    if path.parent.name == "hf":
        overrides = [f"data_jsonl={tmp_path / 'd.jsonl'}", f"prior={tmp_path / 'p.safetensors'}"]
        for name in ("d.jsonl", "p.safetensors"):
            (tmp_path / name).touch()
        cfg = load_config(path, overrides)
        assert cfg.anchor.method == "rpb" and (cfg.anchor.beta, cfg.anchor.eps, cfg.anchor.c) == (1.0, 0.05, 5.0)
    else:
        cfg = load_megatron_config(path)
        assert cfg.notes == []  # the paper's setup exactly
