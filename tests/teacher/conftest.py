"""The teacher tests' shared set-up: a tiny DeepSeek-V3 (Moonlight) model, its data and its route file (with
router probabilities), and an ``rpb train`` configuration of it."""

from __future__ import annotations

import json

import pytest

from rpb.anchors import METHODS
from rpb.collect.hf_routes import write_routes
from rpb.testing.data import conversations, write_jsonl
from rpb.train.config import load_config

MAX_LEN = 192


@pytest.fixture(scope="module")
def setup(tmp_path_factory, save_tiny):
    tmp = tmp_path_factory.mktemp("teacher")
    model = save_tiny("moonlight")
    data = write_jsonl(conversations(12, seed=5), tmp / "train.jsonl")
    routes = tmp / "routes.safetensors"
    write_routes(str(model), data, routes, MAX_LEN, probs_transform="softmax")
    return model, data, routes, tmp


def config(setup, out, method, *overrides, steps=3):
    model, data, _, _ = setup
    coefficient = ["anchor.lambda=1.0"] if METHODS[method].coefficient == "lambda_" else []  # sft reads none
    return load_config(
        None,
        [f"model={model}", f"data_jsonl={data}", f"output_dir={out}", f"anchor.method={method}", *coefficient,
         "anchor.router_transform=softmax", f"train.max_steps={steps}", "train.batch_size=4", "train.lr=3e-3",
         "train.log_every=1", f"train.max_seq_len={MAX_LEN}", "train.calibrate_rows=0", *overrides],
    )  # fmt: skip


def log_of(out) -> list[dict]:
    return [json.loads(line) for line in (out / "log.jsonl").read_text().splitlines()]
