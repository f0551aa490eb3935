"""One step's base routing, as the anchor's hook reads it, and the hooks that capture it from a base forward.

Shape legend: T = the step's tokens (flattened, as the routers see them), L = MoE layers, E = experts, K = top-k,
B = rows, V = vocabulary.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass

import torch

from rpb.adapters import MoELayer
from rpb.observe.hooks import Hooks, RouterCall, on_router_calls


@dataclass
class BaseRouting:
    """The base's routing of one step's tokens. Online: ``logits_LTE``, each MoE layer's router logits on the base's
    own hidden states (float32). Stored: ``ids_LTK``, the base's top-k per token, and ``probs_LTK`` its router
    probabilities there (None: the route file holds ids alone). ``output_BTV``: the base's next-token logits
    (``output-kd``; None when the forward stopped at the last router)."""

    logits_LTE: list[torch.Tensor] | None = None
    ids_LTK: torch.Tensor | None = None
    probs_LTK: torch.Tensor | None = None
    output_BTV: torch.Tensor | None = None
    #: the tokens whose base routing is known (None: every one; GRPO's reference routing: the completions')
    known_T: torch.Tensor | None = None

    @property
    def num_layers(self) -> int:
        return len(self.logits_LTE) if self.logits_LTE is not None else int(self.ids_LTK.shape[0])

    @property
    def num_tokens(self) -> int:
        return int(self.logits_LTE[0].shape[0] if self.logits_LTE is not None else self.ids_LTK.shape[1])

    def nbytes(self) -> int:
        tensors = [*(self.logits_LTE or ()), self.ids_LTK, self.probs_LTK, self.output_BTV]
        return sum(t.numel() * t.element_size() for t in tensors if t is not None)


class _Stop(Exception):
    """Raised by the last router's hook: the rest of the base forward would compute nothing the step reads."""


class RouterCapture:
    """Each MoE layer's router logits of one forward (float32, detached); with ``stop_early`` the forward ends at the
    last MoE router (``run`` catches it)."""

    def __init__(self, layers: list[MoELayer], stop_early: bool):
        self.layers = layers
        self.stop_early = stop_early
        self.logits: dict[int, torch.Tensor] = {}

    def _hook(self, call: RouterCall) -> None:
        logits_TE, _, _ = call.read()
        self.logits[call.pos] = logits_TE.detach().reshape(-1, logits_TE.shape[-1]).float()
        if self.stop_early and call.pos == len(self.layers) - 1:
            raise _Stop

    def run(self, forward) -> tuple[list[torch.Tensor], object]:
        """``(logits_LTE, output)``: ``forward()`` under the hooks; ``output`` None when it stopped early."""
        self.logits = {}
        output = None
        with Hooks.join(on_router_calls(self.layers, self._hook)), contextlib.suppress(_Stop):
            output = forward()
        missing = [self.layers[p].name for p in range(len(self.layers)) if p not in self.logits]
        if missing:
            raise RuntimeError(f"the base forward never ran the routers {missing}: the model does not use them")
        return [self.logits[p] for p in range(len(self.layers))], output
