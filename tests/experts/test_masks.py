"""Training only the chosen experts (rpb.experts.masks), by LoRA and by full fine-tuning: every other expert's
weights stay bit-identical with weight decay on."""

from __future__ import annotations

import pytest
import torch
from safetensors.torch import load_file

from rpb.config import load_config
from rpb.experts import ExpertChoice
from rpb.train import run_training
from tests.fixed_routing import MOE_LAYERS, E

pytestmark = pytest.mark.usefixtures("one_thread")


CHOSEN = {1: [0, 3], 2: [5]}


def trained(fixed, tmp_path, *extra):
    model, data, prior, _ = fixed
    path = tmp_path / "experts.json"
    path.write_text(ExpertChoice(CHOSEN).to_json())
    args = [f"model={model}", f"data_jsonl={data}", f"prior={prior}", f"output_dir={tmp_path / 'run'}",
            "anchor.method=sft", "train.max_steps=3", "train.batch_size=3", "train.lr=1e-2", "train.weight_decay=0.1",
            "train.calibrate_rows=0", *(e.format(path) for e in extra)]  # fmt: skip
    cfg = load_config(None, args)
    out = run_training(cfg, progress=False)
    return load_file(model / "model.safetensors"), load_file(out / "model.safetensors")


def per_expert(state: dict) -> dict:
    """The checkpoint's routed experts as {(layer, expert): concatenated weights}, whatever the saved layout."""
    out = {}
    for key, value in state.items():
        for layer in MOE_LAYERS:
            prefix = f"model.layers.{layer}.mlp.experts."
            if not key.startswith(prefix):
                continue
            rest = key[len(prefix) :]
            if rest[0].isdigit():  # experts.<e>.<proj>.weight
                e = int(rest.split(".")[0])
                out.setdefault((layer, e), []).append(value.reshape(-1))
            else:  # fused: gate_up_proj [E, ...]
                for e in range(value.shape[0]):
                    out.setdefault((layer, e), []).append(value[e].reshape(-1))
    return {k: torch.cat(v) for k, v in out.items()}


@pytest.mark.parametrize("how", ["full", "lora"])
def test_only_the_chosen_experts_train_and_the_rest_stay_bit_identical(fixed, tmp_path, how):
    extra = (
        ["train.only_experts={}"] if how == "full" else ["lora.rank=4", "lora.experts.from={}", "lora.attention=false"]
    )
    base, after = (per_expert(s) for s in trained(fixed, tmp_path, *extra))
    assert base.keys() == after.keys() and len(base) == len(MOE_LAYERS) * E
    for (layer, e), weights in base.items():
        moved = not torch.equal(weights, after[(layer, e)])
        assert moved == (e in CHOSEN[layer]), (how, layer, e)
