"""Crash consistency of ``rpb calibrate`` and ``rpb retention``: killed (SIGKILL) at deterministic points of
publishing their output folder, the folder holds the previous complete result or is absent, never a mix, and
a rerun completes (``rpb.fileio.output_folder``)."""

from __future__ import annotations

import json
import multiprocessing
import os
import re
import signal
import sys
from pathlib import Path

import pytest

from rpb.cli import main
from rpb.collect import collect
from rpb.errors import ArgumentError
from rpb.testing.data import conversations, write_jsonl

pytestmark = pytest.mark.usefixtures("one_thread")


#: the killed runs are forked from this process: what they import is imported already (a fresh interpreter would
#: spend seconds on torch and transformers before the point it is killed at)
FORK = multiprocessing.get_context("fork")


def killed_while_publishing(point: str, out: Path, args: list[str]) -> None:
    """In a forked child: ``rpb`` run on ``args``, killed by SIGKILL (no cleanup runs) while it publishes ``out``.
    ``before-publish``: every file written into the temporary folder, nothing renamed; ``mid-swap``: the previous
    folder renamed away, the new one not yet in its place. Only renames that touch ``out``'s name count."""
    real_replace, calls = os.replace, []

    def replace(src, dst, *a, **kw):
        if out.name in os.path.basename(os.fspath(src)) or out.name in os.path.basename(os.fspath(dst)):
            calls.append((src, dst))
            if len(calls) == {"before-publish": 1, "mid-swap": 2}[point]:
                os.kill(os.getpid(), signal.SIGKILL)
        return real_replace(src, dst, *a, **kw)

    os.replace = replace
    sys.exit(main(args))


def snapshot(folder: Path) -> dict[str, bytes] | None:
    return {p.name: p.read_bytes() for p in sorted(folder.iterdir())} if folder.exists() else None


@pytest.mark.parametrize("command", ["calibrate", "retention"])
def test_a_killed_publish_leaves_the_previous_result_or_none(command, save_tiny, tmp_path):
    model = save_tiny("qwen3_moe")
    data = write_jsonl(conversations(6, seed=1), tmp_path / "d.jsonl")
    out = tmp_path / "out"
    if command == "calibrate":
        prior = tmp_path / "p.safetensors"
        collect(str(model), data, prior, top_k=2, max_seq_len=256, progress=False)
        base = ["calibrate", "--model", str(model), "--prior", str(prior), "--data-jsonl", str(data), "--out", str(out),
                "--rows", "4", "--no-progress", "--device", "cpu"]  # fmt: skip
        first, second = [*base, "--betas", "0.5"], [*base, "--betas", "1,2"]
    else:
        base = ["retention", "--base", str(model), "--data-jsonl", str(data), "--out", str(out), "--no-progress",
                "--device", "cpu"]  # fmt: skip
        first, second = [*base, "--max-rows", "4"], [*base, "--max-rows", "6", "--post", str(model)]
    assert main(first) == 0
    previous = snapshot(out)
    for point, expected in (("before-publish", previous), ("mid-swap", None)):
        child = FORK.Process(target=killed_while_publishing, args=(point, out, second))
        child.start()
        child.join(300)
        assert child.exitcode == -signal.SIGKILL, child.exitcode
        assert snapshot(out) == expected, point  # the previous result whole, or no folder
        if expected is None:  # put the previous result back for the next point
            assert main(first) == 0
            previous = snapshot(out)
    assert main(second) == 0  # the rerun completes, and what the killed runs left beside is gone
    name = "calibrate.json" if command == "calibrate" else "report.json"
    report = json.loads((out / name).read_text())
    assert report["betas"] == [1.0, 2.0] if command == "calibrate" else report["post"] == str(model)
    assert sorted(p.name for p in tmp_path.iterdir() if p.name.startswith(".out.")) == []


def test_a_folder_of_the_users_is_never_replaced(save_tiny, tmp_path):
    out = tmp_path / "mine"
    out.mkdir()
    (out / "notes.txt").write_text("keep")
    data = write_jsonl(conversations(4, seed=1), tmp_path / "d.jsonl")
    with pytest.raises(ArgumentError, match=re.escape("holds files rpb does not write there (notes.txt)")):
        from rpb.retention.run import run_retention

        run_retention(str(save_tiny("qwen3_moe")), data, out, max_rows=4, progress=False, device="cpu")
    assert (out / "notes.txt").read_text() == "keep"
