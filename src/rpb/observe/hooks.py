"""The one place rpb hooks a model for its routing: every router call handed to whoever asks, reversibly.

Six readers go through it: the anchor (``rpb.anchors``, whose callback may replace the router's output in
train mode), the collector's span sums, the routing monitor (router calls, and the model's own inputs for its
labels and attention mask), the trace (``rpb.observe.trace``: native top-k over data), the audit (the hidden
states each router place receives) and routing replay (``rpb.replay``: it records generation's routes and may
replace the router's output with recorded ones). Each registration returns a ``Hooks`` that removes every hook it added,
leaving the model as it was; module identities and parameter names are never touched.

Router hooks sit on ``MoELayer.router``, the module that runs (``rpb.adapters.running_router``); input hooks
on what sits at the router's place (PEFT's wrapper, else the router), as the family's MoE block calls it.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass

import torch
from torch import nn

from rpb.adapters import MoELayer, router_output


@dataclass(frozen=True)
class RouterCall:
    """One router forward: ``pos`` is the MoE layer's position in the model's list of MoE layers."""

    pos: int
    layer: MoELayer
    #: the router module that ran (its ``training`` flag says which mode the forward was in)
    module: nn.Module
    args: tuple
    output: object

    @property
    def hidden(self) -> torch.Tensor:
        """The hidden states the router was called on (its first argument)."""
        return self.args[0]

    def read(self) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor | None]:
        """``(logits_TE, gates_TK, topk_ids_TK)`` of this call (``rpb.adapters.router_output``)."""
        return router_output(self.layer, self.output)


class Hooks:
    """Hooks registered together and removed together: ``remove()`` (or leaving a ``with`` block) drops
    every one of them; removing twice is harmless."""

    def __init__(self, handles: Iterable = ()):
        self._handles = list(handles)

    def __len__(self) -> int:
        return len(self._handles)

    @classmethod
    def join(cls, *groups: Hooks) -> Hooks:
        """One ``Hooks`` removing every hook of ``groups``."""
        return cls(h for group in groups for h in group._handles)

    def remove(self) -> None:
        for h in self._handles:
            h.remove()
        self._handles = []

    def __enter__(self) -> Hooks:
        return self

    def __exit__(self, *exc) -> None:
        self.remove()


def on_router_calls(layers: list[MoELayer], callback: Callable[[RouterCall], object], replaces: bool = False) -> Hooks:
    """Call ``callback(call)`` after every forward of every router in ``layers``. With ``replaces``, a value
    it returns other than None replaces the router's output for the MoE block; otherwise what it returns is
    dropped and the output is the router's own."""

    def hook_for(pos: int):
        layer = layers[pos]

        def hook(module, args, output):
            result = callback(RouterCall(pos, layer, module, args, output))
            return result if replaces else None

        return hook

    return Hooks(m.router.register_forward_hook(hook_for(pos)) for pos, m in enumerate(layers))


def on_router_inputs(layers: list[MoELayer], callback: Callable[[int, torch.Tensor], None]) -> Hooks:
    """Call ``callback(pos, hidden)`` before every forward of what sits at each router's place (PEFT's
    wrapper, else the router), with the hidden states it is handed, positional or by keyword."""

    def hook_for(pos: int):
        def hook(module, args, kwargs):
            callback(pos, args[0] if args else next(iter(kwargs.values())))

        return hook

    return Hooks(
        (m.wrapper or m.router).register_forward_pre_hook(hook_for(pos), with_kwargs=True)
        for pos, m in enumerate(layers)
    )


def on_model_inputs(model: nn.Module, callback: Callable[[tuple, dict], None]) -> Hooks:
    """Call ``callback(args, kwargs)`` before every forward of ``model`` (its ``labels``, ``attention_mask``
    and ``input_ids`` say which tokens the routers' calls of that forward belong to)."""
    return Hooks(
        [model.register_forward_pre_hook(lambda module, args, kwargs: callback(args, kwargs), with_kwargs=True)]
    )


def on_model_outputs(model: nn.Module, callback: Callable[[object], None]) -> Hooks:
    """Call ``callback(output)`` after every forward of ``model`` (generation's recorder reads each step's
    logits from it); what it returns is dropped, the output is the model's own."""
    return Hooks([model.register_forward_hook(lambda module, args, output: callback(output) and None)])
