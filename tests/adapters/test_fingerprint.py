"""The routers' fingerprint read from a checkpoint's safetensors shards equals the one computed on the
loaded model (``routers_sha256``), for every family, sharded or not, in original key names too, and
without loading the model or reading any tensor but the routers'."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file, save_file
from transformers import AutoModel, AutoModelForCausalLM

import rpb.adapters.fingerprint as fingerprint_module
from rpb.adapters import (
    UnsupportedModelError,
    checkpoint_routers_sha256,
    find_moe_layers,
    get_adapter,
    routers_sha256,
)
from rpb.models import load_base_model
from rpb.testing.models import ARCHITECTURES
from tests.conftest import with_tensors_changed


def loaded_fingerprint(model_dir, dtype="float32") -> str:
    model, facts = load_base_model(str(model_dir), dtype, device="cpu")
    return routers_sha256(find_moe_layers(model, facts), facts)


@pytest.mark.parametrize("arch", sorted(ARCHITECTURES))
def test_checkpoint_fingerprint_equals_the_loaded_models(arch, save_tiny):
    found = checkpoint_routers_sha256(save_tiny(arch))
    assert found.routers_sha256 == loaded_fingerprint(save_tiny(arch))
    model, facts = load_base_model(str(save_tiny(arch)), device="cpu")
    layers = find_moe_layers(model, facts)
    assert found.moe_layers == [m.layer_index for m in layers]
    assert found.num_experts == layers[0].router.weight.shape[0]
    assert found.top_k == getattr(model.config, facts.top_k_config)
    # bfloat16 weights hash alike (the fingerprint rounds to bfloat16 either way)
    assert found.routers_sha256 == loaded_fingerprint(save_tiny(arch), "bfloat16")
    assert found.routers_sha256 != checkpoint_routers_sha256(save_tiny(arch, seed=1)).routers_sha256


def test_sharded_checkpoint_is_read_through_its_index(save_tiny, tmp_path):
    model = AutoModelForCausalLM.from_pretrained(str(save_tiny("moonlight")))
    model.save_pretrained(tmp_path, max_shard_size="20KB")
    index = json.loads((tmp_path / "model.safetensors.index.json").read_text())
    assert len(set(index["weight_map"].values())) > 3  # really sharded
    assert checkpoint_routers_sha256(tmp_path).routers_sha256 == loaded_fingerprint(save_tiny("moonlight"))


def test_original_key_names_are_renamed_as_transformers_renames_them(save_tiny, tmp_path):
    """A Mixtral checkpoint in its released layout names the router ``block_sparse_moe.gate``;
    transformers renames it to ``mlp.gate`` on load, and so does the fingerprint."""
    src = save_tiny("mixtral")
    tensors = {
        k.replace(".mlp.gate.", ".block_sparse_moe.gate."): v for k, v in load_file(src / "model.safetensors").items()
    }
    assert any("block_sparse_moe.gate" in k for k in tensors)
    for f in src.iterdir():
        if f.name != "model.safetensors":
            (tmp_path / f.name).write_bytes(f.read_bytes())
    save_file(tensors, tmp_path / "model.safetensors", metadata={"format": "pt"})
    assert checkpoint_routers_sha256(tmp_path).routers_sha256 == loaded_fingerprint(tmp_path)
    assert loaded_fingerprint(tmp_path) == loaded_fingerprint(src)  # transformers did load the renamed routers


def test_only_router_tensors_are_read_and_the_model_is_never_loaded(save_tiny, monkeypatch):
    def refuse(*args, **kwargs):
        raise AssertionError("the model was loaded")

    monkeypatch.setattr(AutoModel, "from_pretrained", refuse)
    monkeypatch.setattr(AutoModelForCausalLM, "from_pretrained", refuse)
    read = []

    class Recording:
        def __init__(self, *args, **kwargs):
            self.inner = safe_open(*args, **kwargs)

        def __enter__(self):
            self.f = self.inner.__enter__()
            return self

        def __exit__(self, *exc):
            return self.inner.__exit__(*exc)

        def keys(self):
            return self.f.keys()

        def get_tensor(self, name):
            read.append(name)
            return self.f.get_tensor(name)

    monkeypatch.setattr(fingerprint_module, "safe_open", Recording)
    found = checkpoint_routers_sha256(save_tiny("moonlight"))
    facts = get_adapter("deepseek_v3")
    per_layer = 1 + (facts.expert_bias is not None)
    assert len(read) == per_layer * len(found.moe_layers)
    assert all(".mlp.gate." in name for name in read)


def test_a_checkpoint_without_the_adapters_routers_is_refused(save_tiny):
    with pytest.raises(UnsupportedModelError, match="e_score_correction_bias"):
        checkpoint_routers_sha256(save_tiny("qwen3_moe"), adapter="deepseek_v3")


def test_the_fingerprint_is_of_bfloat16_bytes():
    a = torch.tensor([[1.0, 2.0]])
    nudged = a + 1e-6  # below bfloat16's resolution at 1 and 2
    assert fingerprint_module.fingerprint([[a]]) == fingerprint_module.fingerprint([[nudged]])
    assert fingerprint_module.fingerprint([[a]]) != fingerprint_module.fingerprint([[a * 1.01]])


def test_gpt_oss_router_bias_is_part_of_the_fingerprint(save_tiny, tmp_path):
    """gpt-oss's router bias sits inside its logits: a prior read off another bias is another base."""
    model_dir = save_tiny("gpt_oss")
    key = "model.layers.1.mlp.router.bias"

    def nudge(tensors):
        tensors[key] += 0.5

    other = with_tensors_changed(model_dir, tmp_path / "other", nudge)
    assert checkpoint_routers_sha256(other).routers_sha256 != checkpoint_routers_sha256(model_dir).routers_sha256
    assert loaded_fingerprint(other) == checkpoint_routers_sha256(other).routers_sha256
