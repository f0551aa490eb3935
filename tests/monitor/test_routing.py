"""The monitor's figures against a hand computation: a checkpoint whose routers were moved by a known amount,
observed on one forward, every figure recomputed in float64 from the hidden states the routers saw."""

from __future__ import annotations

import math

import pytest
import torch

from rpb.adapters import find_moe_layers, get_adapter
from rpb.monitor import FIGURES, MonitorConfig, RoutingMonitor
from rpb.testing.models import build_tiny_model

pytestmark = pytest.mark.usefixtures("one_thread")


def hand_figures(h_TH, w0_EH, w1_EH, k):
    """Qwen3-MoE's rule (softmax, top-k) on the base and the moved router, per the module doc's formulas."""
    z0, z1 = h_TH.double() @ w0_EH.double().T, h_TH.double() @ w1_EH.double().T
    p0, p1 = torch.softmax(z0, -1), torch.softmax(z1, -1)
    ids0, ids1 = p0.topk(k, -1).indices.tolist(), p1.topk(k, -1).indices.tolist()
    overlap = sum(len(set(a) & set(b)) for a, b in zip(ids0, ids1, strict=True)) / (k * len(ids0))
    kl = float((p0 * (p0.log() - p1.log())).sum(-1).mean())
    E = w0_EH.shape[0]
    counts = [sum(e in row for row in ids1) for e in range(E)]
    total, mean = sum(counts), sum(counts) / E
    shares = [c / total for c in counts]
    return {
        "topk_overlap": overlap,
        "kl": kl,
        "load_cv": math.sqrt(sum((c - mean) ** 2 for c in counts) / E) / mean,
        "max_share": max(shares),
        "dead_fraction": sum(c == 0 for c in counts) / E,
        "entropy": -sum(s * math.log(s) for s in shares if s > 0) / math.log(E),
    }


def test_figures_equal_the_hand_computation_on_moved_routers():
    model = build_tiny_model("qwen3_moe", vocab_size=64, seed=3)
    monitor = RoutingMonitor(model, MonitorConfig(per_layer=True)).attach()  # the base's routers, frozen here
    layers = find_moe_layers(model, get_adapter("qwen3_moe"))
    base = [m.router.weight.detach().clone() for m in layers]
    gen = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for m in layers:  # the fine-tune's drift: a known move of every router
            m.router.weight.add_(torch.randn(m.router.weight.shape, generator=gen) * 0.5)
    seen = []
    hooks = [m.router.register_forward_hook(lambda mod, a, o: seen.append(a[0].reshape(-1, a[0].shape[-1]))) for m
             in layers]  # fmt: skip
    ids = torch.randint(1, 64, (2, 12), generator=gen)
    labels = ids.clone()
    labels[:, :5] = -100  # the prompt: not a loss token, not observed
    with torch.no_grad():
        model(input_ids=ids, labels=labels)
    for h in hooks:
        h.remove()
    figures = monitor.flush()
    keep = (labels != -100).reshape(-1)
    for m, w0, h_TH in zip(layers, base, seen, strict=True):
        want = hand_figures(h_TH[keep], w0, m.router.weight.detach(), m.router.top_k)
        got = {name: figures[f"routing/layer_{m.layer_index}/{name}"] for name in FIGURES}
        assert got == pytest.approx(want, rel=1e-6, abs=1e-9), m.layer_index
        assert 0 < want["topk_overlap"] < 1 and want["kl"] > 0  # the move changed something
    means = [figures[f"routing/layer_{m.layer_index}/kl"] for m in layers]
    assert figures["routing/mean/kl"] == pytest.approx(sum(means) / len(means))
    assert monitor.flush() == {}  # the window restarted


def test_unmoved_routers_agree_with_the_base_exactly():
    model = build_tiny_model("moonlight", vocab_size=64, seed=1)  # sigmoid, expert-correction bias, groups
    monitor = RoutingMonitor(model).attach()
    with torch.no_grad():
        model(input_ids=torch.randint(1, 64, (2, 9)))
    figures = monitor.flush()
    assert figures["routing/min/topk_overlap"] == 1.0 and figures["routing/max/kl"] == pytest.approx(0.0, abs=1e-12)
    monitor.remove()


def test_with_an_anchor_installed_the_monitor_reads_its_taps_and_keeps_its_own_window():
    """No hook of the monitor's own on the routers; the same figures as a monitor hooking them itself; the
    anchor's reset (at every log) leaves the monitor's window alone; eval-mode forwards are not tapped."""
    from rpb.anchors import AnchorConfig, install_anchor

    model = build_tiny_model("qwen3_moe", vocab_size=64, seed=3).train()
    layers = find_moe_layers(model, get_adapter("qwen3_moe"))
    E = layers[0].router.weight.shape[0]
    gen = torch.Generator().manual_seed(0)
    prior = torch.softmax(torch.randn(2, 2, len(layers), E, generator=gen) * 3, -1)
    handle = install_anchor(model, AnchorConfig(method="rpb", beta=4.0), prior=prior, record_stats=True)
    tapped = RoutingMonitor(model, anchor=handle).attach()
    assert [len(m.router._forward_hooks) for m in layers] == [1] * len(layers)  # the anchor's hook alone
    own = RoutingMonitor(model).attach()
    with torch.no_grad():
        for m in layers:
            m.router.weight.add_(torch.randn(m.router.weight.shape, generator=gen) * 0.5)
    ids = torch.randint(1, 64, (2, 12), generator=gen)
    labels = ids.clone()
    labels[:, :5] = -100
    span = torch.where(labels == -100, -1, 1)
    sample = torch.arange(2)[:, None].expand(2, 12)
    with torch.no_grad(), handle.step(sample, span, torch.ones_like(ids)):
        model(input_ids=ids, labels=labels)
    assert handle.reset_stats()[0].changed > 0  # the anchor did change selections: the tap gave the router's own
    tapped_figures, own_figures = tapped.flush(), own.flush()
    assert tapped_figures["routing/min/topk_overlap"] < 1
    assert tapped_figures == pytest.approx(own_figures, rel=1e-9)
    model.eval()
    with torch.no_grad():
        model(input_ids=ids, labels=labels)
    assert tapped.flush() == {}
    tapped.remove()
    assert handle.taps == []
    handle.remove()
