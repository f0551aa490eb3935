"""Qwen3.5-MoE: softmax routing whose top-k weights are always renormalised, in a multimodal checkpoint.

Not in ``rpb.testing.models.ARCHITECTURES``: transformers loads every Qwen3.5 folder's tokenizer with its own
byte-level class, which the family-parametrized tests' character tokenizer does not fit. Here: the router
against the rule written out from transformers' ``Qwen3_5MoeTopKRouter`` (tests/test_routing.py), the text
model loaded out of the multimodal checkpoint with the saved router weights, and a ``norm_topk_prob`` the
class would ignore refused."""

from __future__ import annotations

import json
import shutil

import pytest
import torch
from safetensors import safe_open
from transformers import AutoConfig, AutoModelForCausalLM

from rpb.adapters import checkpoint_routers_sha256, find_moe_layers, get_adapter, router_spec, routers_sha256
from rpb.models import ModelLoadError, load_base_model, load_causal_lm
from rpb.routing import route
from rpb.testing.models import randomize_routers
from tests.test_routing import canonical, random_hidden, reference_route

pytestmark = pytest.mark.usefixtures("one_thread")

TEXT = {
    "hidden_size": 32,
    "num_hidden_layers": 4,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 8,
    "moe_intermediate_size": 8,
    "shared_expert_intermediate_size": 8,
    "num_experts": 16,
    "num_experts_per_tok": 4,
    "linear_key_head_dim": 8,
    "linear_value_head_dim": 8,
    "linear_num_key_heads": 2,
    "linear_num_value_heads": 4,
    "layer_types": ["linear_attention"] * 3 + ["full_attention"],
    "vocab_size": 64,
}


def tiny_routers():
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(AutoConfig.for_model("qwen3_5_moe_text", **TEXT))
    randomize_routers(model, 1, scale=4.0)
    facts = get_adapter(model.config.model_type)
    return facts, [m.router for m in find_moe_layers(model.eval(), facts)]


def test_zero_bias_is_the_router_and_a_bias_selects_by_the_rule():
    facts, routers = tiny_routers()
    assert [type(r).__name__ for r in routers] == ["Qwen3_5MoeTopKRouter"] * 4
    gen = torch.Generator().manual_seed(7)
    for i, router in enumerate(routers):
        with torch.no_grad():
            logits_TE, gates_TK, ids_TK = router(random_hidden(router, seed=10 + i))
        spec = router_spec(router, facts)
        got_gates, got_ids = route(logits_TE, spec, torch.zeros_like(logits_TE))
        assert torch.equal(got_ids, ids_TK) and torch.equal(got_gates, gates_TK)  # bit for bit
        bias_TE = torch.randn(logits_TE.shape, generator=gen) * 3.0
        ref_ids, ref_gates = reference_route(router, logits_TE, bias_TE)
        got_gates, got_ids = canonical(*route(logits_TE, spec, bias_TE))
        assert torch.equal(got_ids, ref_ids)
        torch.testing.assert_close(got_gates.double(), ref_gates, rtol=1e-5, atol=1e-6)
        # renormalised top-k weights, from the unbiased logits
        torch.testing.assert_close(got_gates.double().sum(-1), torch.ones(len(got_ids), dtype=torch.float64))
        assert (got_ids != canonical(gates_TK, ids_TK)[1]).any(-1).sum() >= 8  # the bias moved the choice


def test_the_text_model_loads_out_of_the_multimodal_checkpoint(replica):
    saved = replica("qwen3_5_moe")
    assert json.loads((saved / "config.json").read_text())["model_type"] == "qwen3_5_moe"
    model, facts = load_base_model(str(saved), device="cpu")
    assert type(model).__name__ == "Qwen3_5MoeTextModel" and facts.model_type == "qwen3_5_moe"
    layers = find_moe_layers(model, facts)
    with safe_open(str(saved / "model.safetensors"), "pt") as f:  # the shipped layout's names, read directly
        for m in layers:
            saved_EH = f.get_tensor(f"model.language_model.layers.{m.layer_index}.mlp.gate.weight")
            assert torch.equal(m.router.weight, saved_EH)
    assert checkpoint_routers_sha256(saved).routers_sha256 == routers_sha256(layers, facts)


def test_a_norm_topk_prob_the_class_ignores_is_refused(replica, tmp_path):
    edited = tmp_path / "edited"
    shutil.copytree(replica("qwen3_5_moe"), edited)
    config = json.loads((edited / "config.json").read_text())
    config["text_config"]["norm_topk_prob"] = False
    (edited / "config.json").write_text(json.dumps(config))
    for load in (lambda p: load_causal_lm(p), lambda p: load_base_model(p, device="cpu")):
        with pytest.raises(ModelLoadError, match="norm_topk_prob=False: transformers' qwen3_5_moe class ignores it"):
            load(str(edited))
