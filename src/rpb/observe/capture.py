"""Each MoE layer's router logits of one forward, captured by hooks (``RouterCapture``): what a base model's
forward gives ``routing-kd`` (``rpb.teacher``) and ``rpb routes`` (``rpb.collect.hf_routes``).

Shape legend: T = the forward's tokens (flattened, as the routers see them), E = experts.
"""

from __future__ import annotations

import contextlib

import torch

from rpb.adapters import MoELayer
from rpb.observe.hooks import Hooks, RouterCall, on_router_calls


class _Stop(Exception):
    """Raised by the last router's hook: the rest of the base forward would compute nothing the step reads."""


class RouterCapture:
    """Each MoE layer's router logits of one forward (float32, detached); with ``stop_early`` the forward ends at the
    last MoE router (``run`` catches it)."""

    def __init__(self, layers: list[MoELayer], stop_early: bool, hidden: bool = False):
        self.layers = layers
        self.stop_early = stop_early
        self.logits: dict[int, torch.Tensor] = {}
        #: with ``hidden``, each router's input too (``hidden_LTH``, float32, detached)
        self.hidden: dict[int, torch.Tensor] | None = {} if hidden else None

    @property
    def hidden_LTH(self) -> list[torch.Tensor] | None:
        return None if self.hidden is None else [self.hidden[p] for p in range(len(self.layers))]

    def _hook(self, call: RouterCall) -> None:
        logits_TE, _, _ = call.read()
        self.logits[call.pos] = logits_TE.detach().reshape(-1, logits_TE.shape[-1]).float()
        if self.hidden is not None:
            self.hidden[call.pos] = call.hidden.detach().reshape(-1, call.hidden.shape[-1]).float()
        if self.stop_early and call.pos == len(self.layers) - 1:
            raise _Stop

    def run(self, forward) -> tuple[list[torch.Tensor], object]:
        """``(logits_LTE, output)``: ``forward()`` under the hooks; ``output`` None when it stopped early."""
        self.logits = {}
        self.hidden = None if self.hidden is None else {}
        output = None
        with Hooks.join(on_router_calls(self.layers, self._hook)), contextlib.suppress(_Stop):
            output = forward()
        missing = [self.layers[p].name for p in range(len(self.layers)) if p not in self.logits]
        if missing:
            raise RuntimeError(f"the base forward never ran the routers {missing}: the model does not use them")
        return [self.logits[p] for p in range(len(self.layers))], output
