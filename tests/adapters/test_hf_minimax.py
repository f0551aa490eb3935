"""MiniMax-M2: sigmoid routing whose expert-correction bias belongs to the MoE block and reaches the router as
its forward's second argument. The selection against the rule written out from the transformers source,
the fingerprint reading the block's bias, and the collector's parity."""

from __future__ import annotations

import pytest
import torch
from transformers import AutoConfig, AutoModelForCausalLM

from rpb.adapters import call_router, checkpoint_routers_sha256, find_moe_layers, get_adapter, routers_sha256
from rpb.anchors import AnchorConfig, install_anchor
from rpb.collect import collect
from rpb.testing.models import randomize_routers
from tests.collect.test_collector_parity import CONVERSATIONS, expected_prior
from tests.conftest import with_tensors_changed, write_rows
from tests.hand_routing import hand_bias

pytestmark = pytest.mark.usefixtures("one_thread")

TINY = {
    "hidden_size": 32,
    "num_hidden_layers": 3,
    "num_attention_heads": 4,
    "num_key_value_heads": 4,
    "head_dim": 8,
    "intermediate_size": 16,
    "num_local_experts": 8,
    "num_experts_per_tok": 2,
    "rotary_dim": 8,
    "pad_token_id": 0,
    "bos_token_id": None,
    "eos_token_id": None,
}


def build(vocab_size: int, seed: int = 0):
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(AutoConfig.for_model("minimax_m2", vocab_size=vocab_size, **TINY))
    randomize_routers(model, seed + 1, scale=4.0)  # router weights, and the blocks' expert-correction bias
    return model.eval()


@pytest.fixture(scope="module")
def saved(tmp_path_factory, moon_tok):
    out = tmp_path_factory.mktemp("minimax")
    build(len(moon_tok)).save_pretrained(out)
    moon_tok.save_pretrained(out)
    return out


def hand_select(z_TE, block_bias_E, k):
    """MiniMax-M2 (transformers' modeling_minimax_m2): top-k of sigmoid(z) + the block's bias."""
    return [frozenset(r) for r in (torch.sigmoid(z_TE.float()) + block_bias_E).topk(k, dim=-1).indices.tolist()]


def hand_gates(z_TE, ids_TK):
    """sigmoid of the unbiased logits at the chosen experts, renormalised (no scaling)."""
    s = torch.sigmoid(z_TE.double()).gather(1, ids_TK)
    return s / s.sum(-1, keepdim=True)


def test_the_anchor_selects_by_the_rule_with_the_blocks_bias():
    model = build(64)
    layers = find_moe_layers(model, get_adapter("minimax_m2"))
    assert [m.layer_index for m in layers] == [0, 1, 2] and all(m.block is not None for m in layers)
    gen = torch.Generator().manual_seed(3)
    pi = torch.softmax(2.0 * torch.randn(2, 2, 3, 8, generator=gen), -1)
    ids_BT = torch.randint(1, 64, (2, 8), generator=gen)
    sample_BT, span_BT = torch.tensor([[0] * 8, [1] * 8]), torch.tensor([[0, 0, 0, 0, 1, 1, 1, 1]] * 2)
    seen = []
    model.train()
    handle = install_anchor(model, AnchorConfig(method="rpb", beta=1.0), prior=pi)
    # registered after the anchor's hook: sees what the anchor handed on, and the bias the block passed in
    hooks = [m.router.register_forward_hook(lambda mod, a, o: seen.append((a[1].clone(), o))) for m in layers]
    with handle.step(sample_BT, span_BT), torch.no_grad():
        model(input_ids=ids_BT)
    for h in hooks:
        h.remove()
    changed = 0
    for pos, (m, (block_bias_E, (z_TE, gates_TK, ids_TK))) in enumerate(zip(layers, seen, strict=True)):
        assert torch.equal(block_bias_E, m.block.e_score_correction_bias)  # the bias the router got is the block's
        keys = zip(sample_BT.reshape(-1).tolist(), span_BT.reshape(-1).tolist(), strict=True)
        bias_TE = torch.stack([hand_bias(pi[x, s, pos]) for x, s in keys])
        got = [frozenset(r) for r in ids_TK.tolist()]
        assert got == hand_select(z_TE + bias_TE, block_bias_E, 2), f"layer {pos}"
        torch.testing.assert_close(gates_TK.double(), hand_gates(z_TE, ids_TK), rtol=1e-6, atol=1e-7)
        changed += sum(a != b for a, b in zip(got, hand_select(z_TE, block_bias_E, 2), strict=True))
    assert changed > 0  # the prior moved some tokens' experts
    handle.remove()


def test_call_router_hands_the_router_its_blocks_bias():
    """The router called alone, as its block calls it: the selection by the rule with the block's bias (the bare
    ``router(hidden)`` is a TypeError on this family)."""
    model = build(64)
    facts = get_adapter("minimax_m2")
    hidden_TH = torch.randn(16, 32, generator=torch.Generator().manual_seed(5))
    for m in find_moe_layers(model, facts):
        z_TE, gates_TK, ids_TK = call_router(m, facts, hidden_TH)
        torch.testing.assert_close(z_TE, hidden_TH @ m.router.weight.T)
        chosen = hand_select(z_TE, m.block.e_score_correction_bias, 2)
        assert [frozenset(r) for r in ids_TK.tolist()] == chosen
        assert chosen != hand_select(z_TE, torch.zeros(8), 2)  # the bias changes the choice: the test can tell
        torch.testing.assert_close(gates_TK.double(), hand_gates(z_TE, ids_TK), rtol=1e-6, atol=1e-7)


def test_the_fingerprint_reads_the_blocks_bias(saved, tmp_path):
    model = AutoModelForCausalLM.from_pretrained(saved)
    facts = get_adapter("minimax_m2")
    found = checkpoint_routers_sha256(saved)
    assert found.routers_sha256 == routers_sha256(find_moe_layers(model, facts), facts)
    # saved under MiniMax-M2's own names (the block is `block_sparse_moe` there; transformers renames it on load)
    key = "model.layers.1.block_sparse_moe.e_score_correction_bias"

    def nudge(tensors):
        tensors[key] += 0.25

    other = with_tensors_changed(saved, tmp_path / "other", nudge)
    assert checkpoint_routers_sha256(other).routers_sha256 != found.routers_sha256


def test_the_collected_prior_matches_the_routers_logits(saved, moon_tok, tmp_path):
    rows = [{"messages": [{"role": r, "content": c} for r, c in conv]} for conv in CONVERSATIONS]
    data = write_rows(tmp_path / "data.jsonl", rows)
    art = collect(
        str(saved), data, tmp_path / "prior.safetensors", top_k=2, max_seq_len=512, batch_size=2, progress=False
    )
    expected, moe_layers = expected_prior(saved, moon_tok, "softmax")
    assert art.metadata["moe_layers"] == moe_layers == [0, 1, 2]
    torch.testing.assert_close(art.prior_qa.double(), expected, atol=1e-5, rtol=0)
