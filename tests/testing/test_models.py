"""Every shipped tiny architecture builds, is found by its family's adapter, routes non-trivially, and
survives the save / ``from_pretrained`` round trip that real checkpoints take; the toy tokenizer and
synthetic conversations are deterministic."""

from __future__ import annotations

import pytest
import torch
from transformers import AutoModelForCausalLM

from rpb.adapters import find_moe_layers, get_adapter
from rpb.testing.data import conversations, long_conversations
from rpb.testing.models import ARCHITECTURES, build_tiny_model
from rpb.testing.tokenizers import MOONLIGHT_SPECIALS, moonlight_tokenizer


@pytest.mark.parametrize("arch", sorted(ARCHITECTURES))
def test_every_tiny_architecture_loads_back_and_routes_non_trivially(arch, moon_tok, tmp_path):
    model = build_tiny_model(arch, vocab_size=len(moon_tok), seed=0)
    model_type, _ = ARCHITECTURES[arch]
    assert model.config.model_type == model_type
    facts = get_adapter(model_type)
    layers = find_moe_layers(model, facts)
    assert layers and all(layer.router.weight.std() > 0.1 for layer in layers)  # randomised, not init-small
    if facts.expert_bias:
        assert all(getattr(layer.router, facts.expert_bias).abs().sum() > 0 for layer in layers)
    model.save_pretrained(tmp_path)
    again = AutoModelForCausalLM.from_pretrained(tmp_path)
    for a, b in zip(model.state_dict().values(), again.state_dict().values(), strict=True):
        assert torch.equal(a, b)
    assert torch.equal(build_tiny_model(arch, len(moon_tok), seed=0).lm_head.weight, model.lm_head.weight)


def test_the_toy_tokenizer_is_character_level_with_the_markers_whole():
    tok = moonlight_tokenizer()
    ids = tok("ab<|im_end|>c", add_special_tokens=False)["input_ids"]
    assert len(ids) == 4 and tok.convert_ids_to_tokens(ids[2]) == "<|im_end|>"
    assert tok.decode(ids) == "ab<|im_end|>c"
    assert all(tok.convert_tokens_to_ids(s) != tok.unk_token_id for s in MOONLIGHT_SPECIALS)


def test_conversations_are_seeded_and_every_fifth_has_two_exchanges():
    rows = conversations(10, seed=3)
    assert rows == conversations(10, seed=3) and rows != conversations(10, seed=4)
    assert [len(r["messages"]) for r in rows] == [2, 2, 2, 2, 4] * 2
    long = long_conversations(5, seed=0)
    assert all(8 <= len(r["messages"]) <= 20 for r in long)
