"""Router facts as data: the registry, and reading a router's output the same way everywhere."""

from __future__ import annotations

import dataclasses

import pytest
import torch
from torch import nn

from rpb.adapters import ADAPTERS, MoELayer, UnsupportedModelError, get_adapter, register_adapter, router_output
from rpb.collect.collector import SpanAccumulator
from rpb.errors import ArgumentError
from rpb.observe.trace import RouterTap


class LogitsOnlyRouter(nn.Module):
    """A router that returns its logits alone (no selection)."""

    def __init__(self):
        super().__init__()
        self.weight = nn.Parameter(torch.randn(4, 3))

    def forward(self, x):
        return x @ self.weight.T


def test_router_output_reads_the_v5_triple_and_logits_alone():
    layer = MoELayer(1, "model.layers.1.mlp.gate", LogitsOnlyRouter())
    z, w, i = torch.zeros(2, 4), torch.ones(2, 2), torch.zeros(2, 2, dtype=torch.long)
    assert router_output(layer, (z, w, i)) == (z, w, i)
    assert router_output(layer, z) == (z, None, None)
    with pytest.raises(UnsupportedModelError, match=r"model.layers.1.mlp.gate returned a tuple"):
        router_output(layer, (z, w))


def test_the_prior_reads_a_logits_only_router_and_tracing_refuses_it_by_name():
    """The collector needs only logits; reading a selection needs indices: both go through
    ``router_output``, so they agree on what a router returns and fail the same way."""
    router = LogitsOnlyRouter()
    layer = MoELayer(1, "model.layers.1.mlp.gate", router)
    x = torch.randn(1 * 2, 3)
    with SpanAccumulator([layer], "softmax") as acc:
        acc.span_BT = torch.tensor([[0, 1]])
        router(x)
        sums = acc.take()
    expected = torch.softmax(x @ router.weight.T, -1).detach()  # span 0 = token 0, span 1 = token 1
    torch.testing.assert_close(sums[0, 0], expected)
    with RouterTap([layer]), pytest.raises(UnsupportedModelError, match="returns no expert indices"):
        router(x)


def test_registering_a_family_as_data(monkeypatch):
    monkeypatch.setattr("rpb.adapters.hf.ADAPTERS", dict(ADAPTERS))
    import rpb.adapters.hf as hf

    facts = register_adapter(dataclasses.replace(hf.ADAPTERS["qwen3_moe"], model_type="my_moe"))
    assert hf.get_adapter("my_moe") is facts
    with pytest.raises(ArgumentError, match="exists"):
        register_adapter(facts)
    with pytest.raises(ArgumentError, match="score_function"):
        register_adapter(dataclasses.replace(facts, model_type="other", score_function="relu"))
    with pytest.raises(UnsupportedModelError, match="--adapter"):
        get_adapter("not_a_family")


@pytest.mark.parametrize("arch", ["deepseek_v3_grouped", "deepseek_v2", "qwen3_moe"])
def test_chosen_experts_are_the_routers_own_or_the_families_rule_on_logits_alone(arch):
    """A router that returns its ids: those. One that returns its logits alone (the block selecting): the family's
    hand-written rule on them (tests/test_routing.py), the expert-correction bias and groups included."""
    from rpb.adapters import chosen_experts, find_moe_layers
    from tests.test_routing import random_hidden, reference_route, tiny_routers

    model, facts, _ = tiny_routers(arch)
    layer = find_moe_layers(model, facts)[0]
    if facts.expert_bias:  # a bias that moves the choice, as a trained load balancer's does
        getattr(layer.router, facts.expert_bias).data.copy_(torch.linspace(-0.3, 0.3, layer.router.weight.shape[0]))
    with torch.no_grad():
        logits_TE, _, ids_TK = layer.router(random_hidden(layer.router))
    assert torch.equal(chosen_experts(layer, facts, (logits_TE, None, ids_TK)), ids_TK)
    expected, _ = reference_route(layer.router, logits_TE.float(), torch.zeros_like(logits_TE.float()))
    got = chosen_experts(layer, facts, logits_TE)
    assert torch.equal(got.sort(dim=-1).values, expected.sort(dim=-1).values)
