"""The window's routing figures against hand computations, and the hook's base-overlap count."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
from scipy.stats import entropy

from rpb.anchors import AnchorConfig, install_anchor
from rpb.anchors.stats import LayerStats, routing_metrics
from rpb.testing.models import build_tiny_model


def test_figures_are_the_hand_computed_ones():
    load = [3.0, 0.0, 1.0, 4.0]
    s = LayerStats(
        tokens=4,
        content=3,
        changed=2,
        load_E=torch.tensor(load),
        term_sum=0.6,
        term_steps=3,
        overlap=5,
        overlap_tokens=4,
        top_k=2,
    )
    out = routing_metrics(
        {0: s, 1: LayerStats(content=1, load_E=torch.ones(4), top_k=2)}, {0: 1, 1: 3}, loss=True, base=True, prior=True
    )
    assert out["moe/layer_1/load_min"] == 0 and out["moe/layer_1/load_max"] == 0.5
    assert out["moe/layer_1/load_cv"] == pytest.approx(np.std(load) / np.mean(load), abs=1e-6)
    assert out["moe/layer_1/dead_experts"] == 1 and out["moe/layer_3/dead_experts"] == 0
    assert out["moe/layer_1/utilization_entropy_bits"] == pytest.approx(entropy(load, base=2), abs=1e-6)
    assert out["moe/layer_1/bias_changed_fraction"] == pytest.approx(2 / 3, abs=1e-6)
    assert out["moe/layer_1/anchor_loss"] == pytest.approx(0.2) and out["moe/layer_3/anchor_loss"] == 0
    assert out["moe/layer_1/base_topk_overlap_current_hidden"] == pytest.approx(5 / 8)
    assert out["moe/mean/dead_experts"] == 0.5 and out["moe/mean/load_max"] == pytest.approx((0.5 + 0.25) / 2)
    assert out["moe/layer_3/utilization_entropy_bits"] == pytest.approx(math.log2(4))
    bare = routing_metrics({0: s}, {0: 1}, loss=False, base=False, prior=False)
    assert "moe/layer_1/anchor_loss" not in bare and "moe/layer_1/base_topk_overlap_current_hidden" not in bare
    assert "moe/layer_1/bias_changed_fraction" not in bare  # a method that reads no prior: no such figure


def test_pack_round_trips():
    s = LayerStats(
        tokens=7,
        content=5,
        changed=2,
        load_E=torch.tensor([1.0, 6.0]),
        term_sum=0.25,
        term_steps=1,
        overlap=9,
        overlap_tokens=7,
        top_k=2,
    )
    back = LayerStats.unpack(s.pack() * 2, top_k=2)
    assert (back.tokens, back.content, back.changed, back.overlap, back.overlap_tokens) == (14, 10, 4, 18, 14)
    assert back.term_sum == 0.5 and torch.equal(back.load_E, torch.tensor([2.0, 12.0]))


def test_the_hook_counts_the_current_routers_overlap_with_the_base_on_current_hidden():
    """kl-to-base keeps a base router; after the routers move, |S ∩ S_base| is counted per token."""
    model = build_tiny_model("qwen3_moe", 64).train()
    handle = install_anchor(model, AnchorConfig(method="kl-to-base", lambda_=0.5), record_stats=True)
    routers = [m for n, m in model.named_modules() if n.endswith("mlp.gate")]
    base = [r.weight.detach().clone() for r in routers]
    with torch.no_grad():
        for r in routers:
            r.weight.add_(torch.randn(r.weight.shape, generator=torch.Generator().manual_seed(3)) * 0.7)
    hidden = []
    hooks = [
        r.register_forward_hook(lambda m, a, o: hidden.append(a[0].detach().reshape(-1, a[0].shape[-1])))
        for r in routers
    ]
    ids = torch.randint(1, 64, (2, 9), generator=torch.Generator().manual_seed(0))
    with handle.step(torch.zeros(2, 9, dtype=torch.long), torch.ones(2, 9, dtype=torch.long)):
        model(input_ids=ids)
    [h.remove() for h in hooks]
    for pos, (r, w0, h) in enumerate(zip(routers, base, hidden, strict=True)):
        now = torch.softmax(h @ r.weight.detach().T, -1).topk(r.top_k, -1).indices
        then = torch.softmax(h @ w0.T, -1).topk(r.top_k, -1).indices
        shared = sum(len(set(a) & set(b)) for a, b in zip(now.tolist(), then.tolist(), strict=True))
        s = handle.stats[pos]
        assert s.overlap == shared and s.overlap_tokens == 18 and 0 < shared < 18 * r.top_k
        assert s.term_steps == 1 and s.term_sum > 0
    handle.remove()
