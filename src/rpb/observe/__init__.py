"""Observing a model's routers: the one package that hooks them (``hooks``), native routing read over data with
it (``trace``), and one forward's router logits captured (``capture``)."""

from rpb.observe.hooks import Hooks, RouterCall, on_model_inputs, on_router_calls, on_router_inputs
from rpb.observe.trace import RouterTap, decoder_of, route_batch, trace_topk

__all__ = [
    "Hooks",
    "RouterCall",
    "RouterTap",
    "decoder_of",
    "on_model_inputs",
    "on_router_calls",
    "on_router_inputs",
    "route_batch",
    "trace_topk",
]
