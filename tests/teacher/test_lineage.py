"""A folder ``rpb train`` saved, given as ``model:`` to a run that holds its base: refused by name (the real run and
the dry run), unless ``anchor.trained_base`` says the fine-tuned routing is the one to hold."""

from __future__ import annotations

import json

import pytest

from rpb.errors import ArgumentError
from rpb.train.dryrun import DryRunError, dry_run
from rpb.train.run import prepare_run, run_training
from tests.teacher.conftest import config

pytestmark = pytest.mark.usefixtures("one_thread")


def test_a_trained_folder_is_not_taken_as_the_base_without_being_told(setup, tmp_path):
    trained = run_training(config(setup, tmp_path / "sft", "sft", steps=1), progress=False)
    started = json.loads((trained / "rpb_run.json").read_text())["config"]["model"]
    assert started == str(setup[0])
    moved = (trained, *setup[1:])  # the fine-tuned folder as model:
    message = rf"model: {trained} was saved by rpb train \(.*sft, 1 step\(s\) from {started}\).*model={started}"
    with pytest.raises(ArgumentError, match=message):
        prepare_run(config(moved, tmp_path / "kd", "routing-kd"), progress=False)
    cfg = config(moved, tmp_path / "kd", "routing-kd")
    with pytest.raises(DryRunError, match=message):
        dry_run(None, [f"model={cfg.model}", f"data_jsonl={cfg.data_jsonl}", f"output_dir={tmp_path / 'kd'}",
                       "anchor.method=routing-kd", "anchor.lambda=1", "train.max_seq_len=192"])  # fmt: skip
    # told: the fine-tuned model's own routing is held (its frozen copy is that model, its term 0 at step 1)
    run = prepare_run(config(moved, tmp_path / "kd", "routing-kd", "anchor.trained_base=true"), progress=False)
    assert run.info["base"]["mode"] == "frozen-copy"
    run.handle.remove()
    # a method that reads no base does not look: sft from the fine-tuned folder trains as before
    prepare_run(config(moved, tmp_path / "more", "sft"), progress=False).handle.remove()
    with pytest.raises(
        Exception, match=r"anchor.trained_base: read only by the methods with a base \(routing-kd, output-kd"
    ):
        config(moved, tmp_path / "x", "sft", "anchor.trained_base=true")
