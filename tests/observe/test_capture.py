"""``rpb.observe.capture.RouterCapture``: each MoE layer's logits of one forward, as the router's own weight gives
them from the hidden states a hook of the test's own saw; stopped at the last router when asked (no layer after
it runs, no output), every hook gone after; a model that never runs a router is named."""

from __future__ import annotations

import pytest
import torch

from rpb.adapters import find_moe_layers, get_adapter
from rpb.observe.capture import RouterCapture
from rpb.testing.models import build_tiny_model

pytestmark = pytest.mark.usefixtures("one_thread")

VOCAB = 64


@pytest.mark.parametrize("stop_early", [False, True])
def test_each_layers_logits_are_the_routers_own_and_the_forward_stops_when_asked(stop_early):
    model = build_tiny_model("qwen3_moe", vocab_size=VOCAB, seed=0)
    layers = find_moe_layers(model, get_adapter("qwen3_moe"))
    ids = torch.randint(1, VOCAB, (2, 5), generator=torch.Generator().manual_seed(1))
    seen, after = {}, []
    hooks = [
        m.router.register_forward_hook(lambda mod, a, o, p=p: seen.update({p: a[0]})) for p, m in enumerate(layers)
    ]
    hooks.append(model.lm_head.register_forward_hook(lambda *_: after.append(1)))
    before = sum(len(m._forward_hooks) for m in model.modules())
    with torch.no_grad():
        logits, output = RouterCapture(layers, stop_early=stop_early).run(lambda: model(input_ids=ids))
    assert sum(len(m._forward_hooks) for m in model.modules()) == before  # the capture's own hooks are gone
    assert len(logits) == len(layers)
    for p, m in enumerate(layers):
        hidden_TH = seen[p].reshape(-1, seen[p].shape[-1])
        torch.testing.assert_close(logits[p], (hidden_TH @ m.router.weight.T).float())
    assert (output is None) == stop_early and (after == []) == stop_early
    for h in hooks:
        h.remove()


def test_a_forward_that_never_runs_a_router_is_named():
    model = build_tiny_model("qwen3_moe", vocab_size=VOCAB, seed=0)
    layers = find_moe_layers(model, get_adapter("qwen3_moe"))
    with pytest.raises(RuntimeError, match="never ran the routers"):
        RouterCapture(layers, stop_early=False).run(lambda: None)
