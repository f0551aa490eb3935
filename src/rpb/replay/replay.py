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

``forward(predictor=...)`` (no routes) is PR2's recording forward: every router's experts are the family's
selection (``rpb.routing.select``: score function, correction bias, groups) on ``logits + predictor(input)``, the
gates the family's own from the unbiased logits; ``chosen_BSLK`` is what was routed. ``keep_last=C`` keeps each
router's logits (float32, still in the forward's graph) and, with a predictor, its input at the last C positions
of every forward
(``kept_BCLE`` / ``kept_inputs_BCLH``): what PR2's predictor learns from.
"""

from __future__ import annotations

import contextlib

import torch
from torch import nn

from rpb.adapters import find_moe_layers, get_adapter, router_spec
from rpb.adapters.hf import expert_bias_of
from rpb.errors import ArgumentError
from rpb.observe.hooks import Hooks, RouterCall, on_model_inputs, on_router_calls
from rpb.replay.routes import route_dtype
from rpb.routing import combine_weights, select


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
        self._chosen: dict[tuple[int, int], torch.Tensor] = {}
        self._kept: dict[tuple[int, int], tuple[torch.Tensor, torch.Tensor | None]] = {}
        self._predictor: nn.Module | None = None
        self._keep_last = 0
        self._hooks = Hooks.join(
            on_model_inputs(model, self._on_inputs), on_router_calls(self.layers, self._hook, replaces=True)
        )

    def remove(self) -> None:
        self._hooks.remove()

    @contextlib.contextmanager
    def forward(
        self, routes_BSLK: torch.Tensor | None = None, *, predictor: nn.Module | None = None, keep_last: int = 0
    ):
        """Replay ``routes_BSLK`` (None: route freely, recording only) in the forwards inside the block; or, with
        ``predictor`` (a module whose ``delta(pos, input_TH)`` is a ``[T, E]`` correction), route each token to the
        family's selection on the corrected logits. ``keep_last``: keep the last that many positions' router
        logits (and, with a predictor, inputs)."""
        if routes_BSLK is not None:
            self._check(routes_BSLK)
            if predictor is not None:
                raise ArgumentError("routes to replay and a predictor to choose with: one forward does one of them")
        self._active, self._routes_BSLK = True, routes_BSLK
        self._predictor, self._keep_last = predictor, keep_last
        self._offset, self._forwards, self._native, self._chosen, self._kept = 0, 0, {}, {}, {}
        try:
            yield self
        finally:
            self._active, self._routes_BSLK, self._predictor = False, None, None

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
        first_time = key not in self._native  # a recomputation (checkpointing) routes alike, records nothing twice
        if first_time:
            self._native[key] = ids_TK.detach().reshape(B, S, -1).to(route_dtype(logits_TE.shape[-1]))
        if first_time and self._keep_last:
            C = self._keep_last
            inputs = None
            if self._predictor is not None:
                inputs = call.hidden.detach().reshape(B, S, -1)[:, -C:].clone()
            # kept with their graph: the stop-gradient is the predictor's loss's to take (rpb.replay.predictive)
            self._kept[key] = (logits_TE.float().reshape(B, S, -1)[:, -C:], inputs)
        if self._predictor is not None:
            return self._predicted(call, logits_TE, gates_TK, key, first_time)
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

    def _predicted(self, call: RouterCall, logits_TE, gates_TK, key, first_time: bool):
        """PR2's selection: the family's pipeline on the logits plus the predictor's correction, gates from the
        unbiased logits (the correction only chooses)."""
        spec = self.specs[call.pos]
        with torch.no_grad():
            hidden_TH = call.hidden.reshape(logits_TE.shape[0], -1)
            delta_TE = self._predictor.delta(call.pos, hidden_TH)
            ids_TK = select(logits_TE.detach(), spec, delta_TE, expert_bias_of(self.layers[call.pos], self.facts))
        if first_time:
            B, S = self._shape
            self._chosen[key] = ids_TK.reshape(B, S, -1).to(route_dtype(logits_TE.shape[-1]))
        new_gates_TK = combine_weights(logits_TE, ids_TK, spec).to(gates_TK.dtype)
        return logits_TE, new_gates_TK, ids_TK

    # ---- what the block saw ------------------------------------------------------------
    def _seen(self, seen: dict, what: str) -> dict:
        if not seen:
            raise ArgumentError(f"no forward inside the replay block recorded {what}")
        return seen

    @staticmethod
    def _by_rows(seen: dict, layers: int) -> torch.Tensor:
        """``[rows, ..., L, ...]``: each forward's per-layer tensors stacked at dim 2, forwards' rows in order."""
        forwards = sorted({f for f, _ in seen})
        return torch.cat([torch.stack([seen[(f, p)] for p in range(layers)], dim=2) for f in forwards], dim=0)

    @property
    def native_BSLK(self) -> torch.Tensor:
        """The live routers' own top-k at every position of the block's forwards (rows in order)."""
        return self._by_rows(self._seen(self._native, "the routers' own choice"), len(self.layers))

    @property
    def chosen_BSLK(self) -> torch.Tensor:
        """The experts a predictor's forward routed to (PR2's routes, to replay in the later updates)."""
        return self._by_rows(self._seen(self._chosen, "a predictor's choice"), len(self.layers))

    @property
    def kept_BCLE(self) -> torch.Tensor:
        """The routers' logits at the last ``keep_last`` positions (float32)."""
        kept = self._seen(self._kept, "kept logits")
        return self._by_rows({k: v[0] for k, v in kept.items()}, len(self.layers))

    @property
    def kept_inputs_BCLH(self) -> torch.Tensor:
        """The routers' inputs at the last ``keep_last`` positions (a predictor's forward only)."""
        kept = self._seen(self._kept, "kept inputs")
        if any(v[1] is None for v in kept.values()):
            raise ArgumentError("router inputs are kept in a predictor's forward only")
        return self._by_rows({k: v[1] for k, v in kept.items()}, len(self.layers))
