"""The base's routing put into a loss term's state: a step without it, or with another batch's, is refused by name,
and a layer's rows are the base's rows of that layer."""

from __future__ import annotations

import pytest
import torch

from rpb.anchors.base_state import base_into
from rpb.anchors.methods import RouterState, get_method
from rpb.teacher import BaseRouting


def test_a_layers_rows_go_in_and_a_missing_or_foreign_base_is_refused_by_name():
    method = get_method("routing-kd")
    logits_LTE = [torch.randn(5, 4), torch.randn(5, 4)]
    state = RouterState("softmax", 2, "softmax")
    base_into(state, BaseRouting(logits_LTE=logits_LTE), 1, method, None, "layers.2.gate", torch.zeros(5, 4))
    assert torch.equal(state.routing_logits_TE, logits_LTE[1])
    with pytest.raises(RuntimeError, match="this step carries no base routing"):
        base_into(state, None, 0, method, None, "layers.1.gate", torch.zeros(5, 4))
    with pytest.raises(RuntimeError, match=r"covers 5 tokens, router layers\.1\.gate saw 3"):
        base_into(state, BaseRouting(logits_LTE=logits_LTE), 0, method, None, "layers.1.gate", torch.zeros(3, 4))
    with pytest.raises(RuntimeError, match="carries no hidden states"):
        base_into(state, BaseRouting(logits_LTE=logits_LTE), 0, get_method("hidden-kd"), None, "g", torch.zeros(5, 4))
    ids_LTK = torch.tensor([[[0, 1]] * 5, [[2, 3]] * 5])
    base_into(state, BaseRouting(ids_LTK=ids_LTK), 1, method, "set-ce", "g", torch.zeros(5, 4))
    assert state.routing_ids_TK.tolist() == [[2, 3]] * 5 and state.routes_loss == "set-ce"
