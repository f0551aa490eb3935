"""Preemption: a run killed with SIGKILL after a checkpoint resumes to the uninterrupted run's weights,
bit for bit (dropout on: the random draws after the checkpoint must resume too), from a mid-run checkpoint
and from the final one (which trains nothing more); torn checkpoints are never picked; a changed set-up is
refused by name."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file
from transformers import Trainer

from rpb.collect import collect
from rpb.prior.artifact import load_artifact, save_artifact
from rpb.testing.data import conversations, write_jsonl
from rpb.train.checkpoints import MARKER, ResumeError, complete_checkpoints
from rpb.train.config import load_config
from rpb.train.run import run_training
from rpb.train.trainer import AnchorTrainerMixin
from tests.conftest import coefficient_overrides

WORKER = Path(__file__).parents[1] / "workers" / "resume_worker.py"
# one intra-op thread here and in the killed process: the same kernels, so the same floating-point sums
pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture(scope="module")
def setup(tmp_path_factory, save_tiny):
    tmp = tmp_path_factory.mktemp("resume")
    data = write_jsonl(conversations(16, seed=9), tmp / "train.jsonl")
    # attention dropout: every step draws from the RNG, so a resume that does not restore it diverges
    model = save_tiny("qwen3_moe", attention_dropout=0.3)
    prior = tmp / "prior.safetensors"
    collect(str(model), data, prior, top_k=2, max_seq_len=192, progress=False)
    return model, data, prior


def overrides(setup, out, method, *extra):
    model, data, prior = setup
    return [f"model={model}", f"data_jsonl={data}", f"prior={prior}", f"output_dir={out}", f"anchor.method={method}",
            *coefficient_overrides(method, 0.1, 0.01), "train.max_steps=3", "train.batch_size=4", "train.lr=1e-2",
            "train.log_every=1", "train.deterministic=true", "train.calibrate_rows=0", "train.save_every=1",
            *extra]  # fmt: skip


def train(args):
    return run_training(load_config(None, args), progress=False)


TARGET = ("anchor.target=0.999",)


@pytest.mark.parametrize(
    ("method", "extra"), [("rpb", ()), ("kl-to-base", ()), ("within-soft", ()), ("routing-kd", TARGET)]
)
def test_killed_and_resumed_equals_uninterrupted(setup, method, extra, tmp_path):
    """With a routing target, λ too: the controller's state comes back from the checkpoint the kill left."""
    whole_dir = train(overrides(setup, tmp_path / "whole", method, *extra))
    whole = load_file(whole_dir / "model.safetensors")

    out = tmp_path / "killed"
    kill_after(setup, out, 1, method, *extra)
    assert [d.name for d in complete_checkpoints(out)] == ["checkpoint-1"]
    assert (out / "checkpoint-2").is_dir() and not (out / "checkpoint-2" / MARKER).exists()  # torn, left as it is

    again = overrides(setup, out, method, *extra, "train.resume_from_checkpoint=auto")
    resumed = load_file(train(again) / "model.safetensors")
    assert whole.keys() == resumed.keys() and all(torch.equal(whole[k], resumed[k]) for k in whole), method
    logs = [[r for r in map(json.loads, (d / "log.jsonl").read_text().splitlines()) if "loss" in r]
            for d in (out, whole_dir)]  # fmt: skip
    assert [r["step"] for r in logs[0]] == [1, 2, 3]  # the killed run's later records dropped, the resumed ones once
    if extra:
        lams = [[r["anchor/lambda"] for r in log] for log in logs]
        assert lams[0] == lams[1] and lams[1][-1] != 1.0  # λ had moved, and moved on as the uninterrupted run's


def test_a_kill_during_a_save_leaves_that_checkpoint_unmarked(setup, tmp_path):
    """The marker is written after the Trainer's whole save: killed in the middle of saving checkpoint 2 (its
    weights written, its optimizer state not), checkpoint 2 has no marker and `auto` would take checkpoint 1."""
    out = tmp_path / "killed"
    kill_after(setup, out, 2, "rpb", during_save=True)
    torn = out / "checkpoint-2"
    assert (torn / "model.safetensors").is_file() and not (torn / "optimizer.pt").exists()
    assert not (torn / MARKER).exists()
    assert [d.name for d in complete_checkpoints(out)] == ["checkpoint-1"]


def kill_after(setup, out, step, method, *extra, during_save: bool = False) -> None:
    """Run in another process and SIGKILL it once its checkpoint at ``step`` is complete (``during_save``: in
    the middle of writing it)."""
    env = {**os.environ, "OMP_NUM_THREADS": "1", **({"RPB_KILL_DURING_SAVE": "1"} if during_save else {})}
    done = subprocess.run([sys.executable, str(WORKER), str(step), *overrides(setup, out, method, *extra)], env=env,
                          capture_output=True, text=True, timeout=300)  # fmt: skip
    assert done.returncode == -9, done.stderr[-3000:]


@pytest.fixture(scope="module")
def killed_at_the_end(setup, tmp_path_factory):
    """max_steps 3, a checkpoint every 2 steps (so at 2, and at 3 as the run ends), killed after checkpoint 3
    and before the final save: the likeliest kill point at the end of a preemptible job. Also the
    uninterrupted run's weights."""
    tmp = tmp_path_factory.mktemp("end")
    extra = ("train.save_every=2",)
    whole = load_file(train(overrides(setup, tmp / "whole", "rpb", *extra)) / "model.safetensors")
    kill_after(setup, tmp / "killed", 3, "rpb", *extra)
    assert [d.name for d in complete_checkpoints(tmp / "killed")] == ["checkpoint-2", "checkpoint-3"]
    assert not (tmp / "killed" / "model.safetensors").exists()
    return tmp / "killed", whole, extra


def check_resume(setup, killed, whole, extra, spec, tmp_path) -> None:
    """Resume a copy of ``killed`` from ``spec``: the uninterrupted run's weights bit for bit, 3 steps in the
    log and in rpb_run.json, no checkpoint past max_steps."""
    out = tmp_path / "resumed"
    shutil.copytree(killed, out)
    spec = spec if spec == "auto" else str(out / spec)
    resumed = load_file(train(overrides(setup, out, "rpb", *extra, f"train.resume_from_checkpoint={spec}"))
                        / "model.safetensors")  # fmt: skip
    assert [d.name for d in complete_checkpoints(out)] == ["checkpoint-2", "checkpoint-3"]
    assert whole.keys() == resumed.keys() and all(torch.equal(whole[k], resumed[k]) for k in whole)
    steps = [r["step"] for r in map(json.loads, (out / "log.jsonl").read_text().splitlines()) if "loss" in r]
    assert steps == [1, 2, 3]
    record = json.loads((out / "rpb_run.json").read_text())
    assert record["global_step"] == 3 and Path(record["resumed_from"]).name in ("checkpoint-2", "checkpoint-3")


def test_a_kill_after_the_final_checkpoint_resumes_to_nothing_more(setup, killed_at_the_end, tmp_path):
    check_resume(setup, *killed_at_the_end, "auto", tmp_path)


def test_a_resume_between_checkpoints_that_do_not_divide_max_steps(setup, killed_at_the_end, tmp_path):
    check_resume(setup, *killed_at_the_end, "checkpoint-2", tmp_path)


def test_mutant_one_more_step_after_the_final_checkpoint_is_caught(setup, killed_at_the_end, tmp_path, monkeypatch):
    """The bug this guards: the Trainer took one more step (checkpoint-4 appeared after max_steps 3)."""
    monkeypatch.delattr(AnchorTrainerMixin, "get_batch_samples")
    with pytest.raises(AssertionError):
        check_resume(setup, *killed_at_the_end, "auto", tmp_path)


def test_mutant_random_state_not_restored_is_caught(setup, killed_at_the_end, tmp_path, monkeypatch):
    """A resume that restores weights, optimizer and data position but not the RNG: dropout draws anew."""
    monkeypatch.setattr(Trainer, "_load_rng_state", lambda self, checkpoint: None)
    with pytest.raises(AssertionError):
        check_resume(setup, *killed_at_the_end, "checkpoint-2", tmp_path)


def test_auto_without_a_complete_checkpoint_starts_fresh(setup, tmp_path):
    out = tmp_path / "fresh"
    (out / "checkpoint-5").mkdir(parents=True)  # torn: no marker
    train(overrides(setup, out, "rpb", "train.max_steps=1", "train.resume_from_checkpoint=auto"))
    assert [d.name for d in complete_checkpoints(out)] == ["checkpoint-1"]


def test_a_changed_setup_is_refused_by_name(setup, tmp_path, save_tiny):
    prior = setup[2]
    out = tmp_path / "run"
    train(overrides(setup, out, "kl-to-base", "train.max_steps=1"))
    resume = "train.resume_from_checkpoint=auto"

    with pytest.raises(ResumeError, match=r"method\.method: the checkpoint's run has 'kl-to-base', this run has 'rpb'"):
        train(overrides(setup, out, "rpb", resume))

    # the same rows and metadata, two values of one row of pi swapped: a prior the checks before training accept
    other_prior = tmp_path / "other.safetensors"
    art = load_artifact(prior, mmap=False)
    art.prior_qa[0, 0, 0, [0, 1]] = art.prior_qa[0, 0, 0, [1, 0]]
    save_artifact(art, other_prior)  # with the hash of its own tensors
    with pytest.raises(ResumeError, match=r"\(1 field\(s\)\):\n  prior\.sha256"):
        train([*overrides(setup, out, "kl-to-base", resume), f"prior={other_prior}"])

    # without a prior (kl-to-base needs none) the resume record is all that checks the data and the base
    no_prior = ["prior=", "train.max_seq_len=192"]
    bare = tmp_path / "bare"
    train([*overrides(setup, bare, "kl-to-base", "train.max_steps=1"), *no_prior])
    other_data = write_jsonl(conversations(16, seed=10), tmp_path / "other.jsonl")
    other_base = save_tiny("qwen3_moe", seed=1)
    with pytest.raises(ResumeError, match=r"\(1 field\(s\)\):\n  data\.sha256"):
        train([*overrides(setup, bare, "kl-to-base", resume), *no_prior, f"data_jsonl={other_data}"])
    with pytest.raises(ResumeError, match=r"\(1 field\(s\)\):\n  base\.routers_sha256"):
        train([*overrides(setup, bare, "kl-to-base", resume), *no_prior, f"model={other_base}"])


def test_a_path_without_a_marker_is_refused(setup, tmp_path):
    torn = tmp_path / "checkpoint-3"
    torn.mkdir()
    with pytest.raises(Exception, match="not a complete rpb checkpoint"):
        train(overrides(setup, tmp_path, "rpb", f"train.resume_from_checkpoint={torn}"))
    shutil.rmtree(torn)
