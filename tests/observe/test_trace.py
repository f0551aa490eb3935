"""``rpb.observe.trace``: native routing read over data, checked against the routers' own outputs caught by a
plain hook of the test's, and the family's selection written by hand (``tests.test_routing``)."""

from __future__ import annotations

import pytest
import torch

from rpb.adapters import find_moe_layers, get_adapter
from rpb.data import Example, collate
from rpb.observe import RouterTap, decoder_of, route_batch, trace_topk
from rpb.testing.models import build_tiny_model
from tests.test_routing import reference_route

pytestmark = pytest.mark.usefixtures("one_thread")

VOCAB = 64
# rows of unequal length: collate pads the shorter ones, whose padding trace_topk marks invalid
EXAMPLES = [
    Example(0, [5, 9, 14, 3, 22, 7], [-1, 0, 0, -1, 1, 1]),
    Example(1, [8, 30, 2], [-1, 0, 1]),
    Example(2, [11, 4, 19, 40], [-1, 0, 1, 1]),
]


def tiny():
    model = build_tiny_model("qwen3_moe", vocab_size=VOCAB).train()
    return model, find_moe_layers(model, get_adapter("qwen3_moe"))


def outputs_of_routers(model, layers, run) -> list[list[tuple]]:
    """Per router call, what the router returned, caught by the test's own hooks during ``run()``."""
    seen = [[] for _ in layers]
    hooks = [m.router.register_forward_hook(lambda mod, a, out, i=i: seen[i].append(out)) for i, m in enumerate(layers)]
    try:
        run()
    finally:
        for h in hooks:
            h.remove()
    return seen


def test_decoder_of_is_the_base_model_or_the_module_itself():
    model, _ = tiny()
    assert decoder_of(model) is model.model
    assert decoder_of(model.model.layers[0]) is model.model.layers[0]


def test_route_batch_runs_the_decoder_alone_and_the_tap_keeps_the_routers_last_output():
    model, layers = tiny()
    batch = collate(EXAMPLES, 0)
    head = []
    model.lm_head.register_forward_hook(lambda *a: head.append(1))
    with RouterTap(layers) as tap:
        seen = outputs_of_routers(model, layers, lambda: route_batch(model, batch))
    assert head == []  # no vocabulary logits computed
    for pos, (out,) in enumerate(seen):
        assert tap.logits[pos] is out[0] and tap.topk_ids[pos] is out[2]
        assert not out[0].requires_grad  # inference mode
    assert all(len(m.router._forward_hooks) == 0 for m in layers)


def test_trace_topk_hands_every_layers_native_selection_and_the_valid_tokens():
    model, layers = tiny()
    got = {}

    def consume(pos, ids_TK, logits_TE, valid_T, span_T):
        got.setdefault(pos, []).append((ids_TK, logits_TE, valid_T, span_T))

    tokens = trace_topk(model, layers, EXAMPLES, consume, batch_size=2)
    assert tokens == sum(len(e) for e in EXAMPLES)
    assert model.training  # the caller's mode comes back
    for pos, layer in enumerate(layers):
        batches = got[pos]
        assert len(batches) == 2
        valid = torch.cat([v for _, _, v, _ in batches])
        spans = torch.cat([s for _, _, _, s in batches])
        # batch 1: rows 0 and 1 (6 tokens each, 3 of row 1 padding); batch 2: row 2 alone
        assert valid.tolist() == [True] * 6 + [True] * 3 + [False] * 3 + [True] * 4
        assert spans[valid].tolist() == [s for e in EXAMPLES for s in e.span_ids]
        for ids_TK, logits_TE, _, _ in batches:
            ref_ids, _ = reference_route(layer.router, logits_TE, torch.zeros_like(logits_TE))
            assert torch.equal(ids_TK.sort(-1).values, ref_ids)
