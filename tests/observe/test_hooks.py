"""``rpb.observe.hooks``: every router call handed over as the router made it, replaced only when asked, and
every hook gone after ``remove()``. The routers' outputs are checked against the family's selection written
by hand (``tests.test_routing``) on the logits recomputed from the hidden states each call received."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from rpb.adapters import MoELayer, find_moe_layers, get_adapter
from rpb.observe import on_model_inputs, on_router_calls, on_router_inputs
from rpb.testing.models import build_tiny_model
from tests.test_routing import canonical, reference_route

pytestmark = pytest.mark.usefixtures("one_thread")

VOCAB = 64


def tiny(seed: int = 0):
    model = build_tiny_model("qwen3_moe", vocab_size=VOCAB, seed=seed)
    return model, find_moe_layers(model, get_adapter("qwen3_moe"))


def input_ids(seed: int = 1) -> torch.Tensor:
    return torch.randint(1, VOCAB, (2, 5), generator=torch.Generator().manual_seed(seed))


def hook_count(model: nn.Module) -> int:
    return sum(len(m._forward_hooks) + len(m._forward_pre_hooks) for m in model.modules())


def test_each_router_call_is_handed_over_in_layer_order_as_the_router_made_it():
    model, layers = tiny()
    calls = []
    with on_router_calls(layers, calls.append):
        model(input_ids=input_ids())
    assert [c.pos for c in calls] == list(range(len(layers)))
    for call, layer in zip(calls, layers, strict=True):
        assert call.layer is layer and call.module is layer.router
        hidden_TH = call.hidden.reshape(-1, call.hidden.shape[-1])
        logits_TE, gates_TK, ids_TK = call.read()
        torch.testing.assert_close(logits_TE, hidden_TH @ layer.router.weight.T)  # qwen3_moe: a bias-free linear
        ref_ids, ref_gates = reference_route(layer.router, logits_TE, torch.zeros_like(logits_TE))
        gates, ids = canonical(gates_TK, ids_TK)
        assert torch.equal(ids, ref_ids)
        torch.testing.assert_close(gates.detach().double(), ref_gates, atol=1e-6, rtol=1e-5)


def test_a_replacement_reaches_the_block_only_when_asked_and_every_hook_goes_on_removal():
    model, layers = tiny()
    before = hook_count(model)

    def force_first_experts(call):
        logits_TE, gates_TK, ids_TK = call.read()
        return logits_TE, gates_TK, torch.arange(ids_TK.shape[1]).expand_as(ids_TK).clone()

    seen = []  # a hook added afterwards sees what the MoE block receives
    for replaces in (False, True):
        hooks = on_router_calls(layers, force_first_experts, replaces=replaces)
        later = [m.router.register_forward_hook(lambda mod, a, out: seen.append(out[2])) for m in layers]
        with torch.no_grad():
            model(input_ids=input_ids())
        hooks.remove()
        hooks.remove()  # twice: harmless
        for h in later:
            h.remove()
    native, forced = seen[: len(layers)], seen[len(layers) :]
    k = native[0].shape[1]
    assert all(not (ids == torch.arange(k)).all() for ids in native)  # the router's own choice, untouched
    assert all((ids == torch.arange(k)).all() for ids in forced)
    assert hook_count(model) == before


def test_router_inputs_are_read_at_the_wrapper_positional_or_by_keyword():
    class Router(nn.Module):
        def __init__(self):
            super().__init__()
            self.weight = nn.Parameter(torch.randn(4, 3))

        def forward(self, hidden_states):
            return hidden_states @ self.weight.T

    class Wrapper(nn.Module):
        def __init__(self, router):
            super().__init__()
            self.base_layer = router

        def forward(self, hidden_states):
            return self.base_layer(hidden_states)

    router = Router()
    wrapper = Wrapper(router)
    plain, wrapped = MoELayer(0, "plain", Router()), MoELayer(1, "wrapped", router, wrapper=wrapper)
    x, y, z = torch.randn(2, 3), torch.randn(5, 3), torch.randn(1, 3)
    seen = []
    with on_router_inputs([plain, wrapped], lambda pos, hidden: seen.append((pos, hidden))) as hooks:
        plain.router(x)
        wrapper(hidden_states=y)
        router(z)  # the router under the wrapper is not the place the block calls
        assert len(hooks) == 2
    plain.router(x)
    assert [p for p, _ in seen] == [0, 1]
    assert seen[0][1] is x and seen[1][1] is y


def test_the_models_own_inputs_come_before_its_routers_calls():
    model, layers = tiny()
    order = []
    ids = input_ids()
    labels = ids.masked_fill(ids > 32, -100)
    read_inputs = on_model_inputs(model, lambda args, kwargs: order.append(("model", kwargs)))
    with read_inputs as hooks, on_router_calls(layers, lambda call: order.append(("router", call.pos))):
        model(input_ids=ids, labels=labels)
    assert len(hooks) == 0
    (first, kwargs), *rest = order
    assert first == "model" and kwargs["labels"] is labels and kwargs["input_ids"] is ids
    assert rest == [("router", pos) for pos in range(len(layers))]
    assert hook_count(model) == 0
