"""Routing replay for a Hugging Face MoE model: the training forward routes every token to the experts recorded
for it, its gates taken from the live router at those experts.

Shape legend: B = rows of a forward, S = positions, L = MoE layers, K = top-k, E = routed experts, T = the
router's flattened ``B x S`` tokens.

Inside ``with replay.forward(routes_BSLK):`` every router call of every forward is handled so:

* at a position with a route, the experts are the recorded ones; the gates are the family's own
  (``rpb.routing.combine_weights``: score function, renormalisation, scaling) computed from the live logits at
  those ids, so the router keeps its gradient, as Megatron-Core's ``RouterReplay`` does. The family's
  expert-correction bias and expert groups choose nothing: they only ever choose, and the choice is given.
* at a position without one (padding, a rollout's last token: -1), the router's own output stands.

Forwards inside one block take consecutive rows of ``routes_BSLK`` (TRL scores a batch in chunks). A forward
recomputed during backward (activation checkpointing) replays the rows of the last forward, so keep one forward
with gradients per block, as a training step does. Whatever the block replays, it records the live router's own
top-k at every position (``native_BSLK``): what the router would have chosen, for the mismatch figures and for
``R2``, which replays the first forward's own choice in later updates.
"""

from __future__ import annotations

import contextlib

import torch
from torch import nn

from rpb.adapters import find_moe_layers, get_adapter, router_spec
from rpb.errors import ArgumentError
from rpb.observe.hooks import Hooks, RouterCall, on_model_inputs, on_router_calls
from rpb.replay.routes import route_dtype
from rpb.routing import combine_weights


class RouteReplay:
    """Replay installed on ``model`` (``adapter``: the family's model_type, default the config's). Hooks only:
    ``remove()`` leaves the model as it was; outside a ``forward`` block every router runs untouched."""

    def __init__(self, model: nn.Module, adapter: str | None = None):
        self.model = model
        self.facts = get_adapter(adapter or model.config.model_type)
        self.layers = find_moe_layers(model, self.facts)
        self.specs = [router_spec(m.router, self.facts) for m in self.layers]
        self._active = False
        self._routes_BSLK: torch.Tensor | None = None
        self._offset, self._rows, self._shape, self._forwards = 0, slice(0, 0), (0, 0), 0
        self._native: dict[tuple[int, int], torch.Tensor] = {}
        self._hooks = Hooks.join(
            on_model_inputs(model, self._on_inputs), on_router_calls(self.layers, self._hook, replaces=True)
        )

    def remove(self) -> None:
        self._hooks.remove()

    @contextlib.contextmanager
    def forward(self, routes_BSLK: torch.Tensor | None = None):
        """Replay ``routes_BSLK`` (None: route freely, recording only) in the forwards inside the block."""
        if routes_BSLK is not None:
            self._check(routes_BSLK)
        self._active, self._routes_BSLK = True, routes_BSLK
        self._offset, self._forwards, self._native = 0, 0, {}
        try:
            yield self
        finally:
            self._active, self._routes_BSLK = False, None

    def _check(self, routes_BSLK: torch.Tensor) -> None:
        L, K, E = len(self.layers), self.specs[0].top_k, self.specs[0].num_experts
        problems = []
        if routes_BSLK.dim() != 4 or tuple(routes_BSLK.shape[2:]) != (L, K):
            problems.append(f"routes of shape {tuple(routes_BSLK.shape)}: expected [rows, positions, {L}, {K}]")
        elif routes_BSLK.numel() and int(routes_BSLK.max()) >= E:
            problems.append(f"expert id {int(routes_BSLK.max())} recorded; the model has {E} routed experts")
        if routes_BSLK.is_floating_point():
            problems.append(f"routes of dtype {routes_BSLK.dtype}: expert ids are integers")
        if problems:
            raise ArgumentError("routes that do not fit the model:\n  " + "\n  ".join(problems))

    # ---- the hooks -------------------------------------------------------------------
    def _on_inputs(self, args, kwargs) -> None:
        if not self._active:
            return
        ids = kwargs.get("input_ids", args[0] if args else None)
        shape = tuple((ids if ids is not None else kwargs["inputs_embeds"]).shape[:2])
        self._rows, self._shape = slice(self._offset, self._offset + shape[0]), shape
        self._offset += shape[0]
        self._forwards += 1

    def _hook(self, call: RouterCall):
        if not self._active:
            return None
        logits_TE, gates_TK, ids_TK = call.read()
        B, S = self._shape
        if ids_TK is None or logits_TE.shape[0] != B * S:
            raise ArgumentError(
                f"router {call.layer.name} saw {logits_TE.shape[0]} tokens in a forward of {B} x {S}: routing "
                "replay needs the router's top-k over every token of the forward"
            )
        key = (self._forwards, call.pos)
        if key not in self._native:  # a recomputation (checkpointing) routes alike and records nothing twice
            self._native[key] = ids_TK.detach().reshape(B, S, -1).to(route_dtype(logits_TE.shape[-1]))
        if self._routes_BSLK is None:
            return None
        routes_BSK = self._routes_BSLK[self._rows, :, call.pos]
        if tuple(routes_BSK.shape[:2]) != (B, S):
            raise ArgumentError(
                f"routes for rows {self._rows.start}..{self._rows.stop - 1} and {routes_BSK.shape[1]} positions; the "
                f"forward has {B} x {S} tokens"
            )
        recorded_TK = routes_BSK.reshape(B * S, -1).to(device=ids_TK.device, dtype=ids_TK.dtype)
        has_T1 = (recorded_TK >= 0).all(dim=-1, keepdim=True)
        new_ids_TK = torch.where(has_T1, recorded_TK, ids_TK)
        new_gates_TK = combine_weights(logits_TE, new_ids_TK, self.specs[call.pos]).to(gates_TK.dtype)
        return logits_TE, torch.where(has_T1, new_gates_TK, gates_TK), new_ids_TK

    # ---- what the block saw ------------------------------------------------------------
    @property
    def native_BSLK(self) -> torch.Tensor:
        """The live routers' own top-k at every position of the block's forwards (rows in order)."""
        if not self._native:
            raise ArgumentError("no forward ran inside the replay block")
        forwards = sorted({f for f, _ in self._native})
        per_forward = [torch.stack([self._native[(f, p)] for p in range(len(self.layers))], dim=2) for f in forwards]
        return torch.cat(per_forward, dim=0)
