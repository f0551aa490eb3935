"""Kimi-K2's ``model_type: kimi_k2``, which transformers does not map, loads as DeepSeek-V3 through rpb."""

from __future__ import annotations

import json
import subprocess
import sys

import torch
from transformers.models.deepseek_v3 import DeepseekV3ForCausalLM, DeepseekV3Model

from rpb.adapters import find_moe_layers, get_adapter
from rpb.models import load_base_model, load_causal_lm
from rpb.testing.models import build_tiny_model


def test_transformers_alone_does_not_know_kimi_k2():
    """The failure the alias prevents (a fresh process: nothing of rpb imported)."""
    code = "from transformers import AutoConfig; AutoConfig.for_model('kimi_k2')"
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert done.returncode != 0 and "kimi_k2" in done.stderr


def test_a_kimi_k2_checkpoint_loads_as_deepseek_v3_without_remote_code(tmp_path, moon_tok):
    model = build_tiny_model("kimi_k2", vocab_size=len(moon_tok))
    model.save_pretrained(tmp_path)
    config = json.loads((tmp_path / "config.json").read_text())
    # as Kimi-K2 ships: its own model_type, DeepSeek-V3's architecture, remote code it never runs here
    config |= {"architectures": ["DeepseekV3ForCausalLM"], "auto_map": {"AutoConfig": "configuration_deepseek.X"}}
    (tmp_path / "config.json").write_text(json.dumps(config))
    assert config["model_type"] == "kimi_k2"
    lm = load_causal_lm(str(tmp_path))
    assert isinstance(lm, DeepseekV3ForCausalLM) and lm.config.model_type == "kimi_k2"
    base, facts = load_base_model(str(tmp_path), device="cpu")
    assert isinstance(base, DeepseekV3Model) and facts is get_adapter("kimi_k2")
    assert facts.router_class == "DeepseekV3TopkRouter" and facts.expert_bias == "e_score_correction_bias"
    layers = find_moe_layers(lm, facts)
    assert [m.layer_index for m in layers] == [1, 2]  # first_k_dense_replace 1
    saved = {k: v for k, v in model.state_dict().items()}
    assert all(torch.equal(saved[k], v) for k, v in lm.state_dict().items())
