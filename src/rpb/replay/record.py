"""Recording a rollout as ``model.generate`` makes it: each MoE layer's top-k at every forwarded token, and the
log-probability of every generated token.

Shape legend: B = rollouts, P = the left-padded prompt's length, S = forwarded positions, L = MoE layers,
K = top-k, C = generated tokens, V = vocabulary.

``generate`` with its KV cache forwards the whole prompt once, then one new token per step; the last generated
token is never forwarded, so it has no route (engines say the same). The recorder stacks each forward's router
output into ``routes_BSLK`` over positions ``0 .. P + C - 2`` of generation's own padded layout (pad positions
included: ``rollout_routes`` keeps the real tokens' alone).

Log-probabilities are read from the raw logits of each step divided by the sampling temperature, before any
warper (top-k, top-p), as an engine reports its sampling log-probabilities; each step's row is kept only until
the next step's input says which token was drawn, so memory stays ``B x V``, not ``B x C x V``.
"""

from __future__ import annotations

import torch

from rpb.adapters import MoELayer, RouterFacts, chosen_experts
from rpb.errors import ArgumentError
from rpb.observe.hooks import Hooks, RouterCall, on_model_inputs, on_model_outputs, on_router_calls
from rpb.replay.routes import route_dtype


class GenerationRecorder:
    """``with GenerationRecorder(model, layers, temperature) as rec: out = model.generate(...)``, then
    ``rec.routes_BSLK`` and ``rec.logps(out_ids)``. ``model`` is the module ``generate`` forwards (the causal LM,
    under any PEFT wrapper), ``layers`` its MoE layers (``rpb.adapters.find_moe_layers``). ``facts``: the family,
    for routers that return their logits alone (the MoE block selects): their selection is the family's own
    (``rpb.adapters.chosen_experts``); without it such a router is refused."""

    def __init__(
        self,
        model: torch.nn.Module,
        layers: list[MoELayer],
        temperature: float = 1.0,
        facts: RouterFacts | None = None,
    ):
        if temperature <= 0:
            raise ArgumentError(f"temperature={temperature}: the log-probabilities need a positive temperature")
        self.model, self.layers, self.temperature, self.facts = model, layers, float(temperature), facts
        self._hooks = Hooks()
        self._shape: tuple[int, int] | None = None
        self._steps: list[list[torch.Tensor]] = []  # per forward: each layer's ids [B, s, K]
        self._logps: list[torch.Tensor] = []  # per generated token but the last: [B]
        self._last_logp_BV: torch.Tensor | None = None
        #: P, the left-padded prompt's length (the first forward's)
        self.prompt_len = 0

    def __enter__(self) -> GenerationRecorder:
        self._steps, self._logps, self._last_logp_BV = [], [], None
        self._hooks = Hooks.join(
            on_model_inputs(self.model, self._on_inputs),
            on_router_calls(self.layers, self._on_router),
            on_model_outputs(self.model, self._on_outputs),
        )
        return self

    def __exit__(self, *exc) -> None:
        self._hooks.remove()

    # ---- the hooks -----------------------------------------------------------------
    def _on_inputs(self, args, kwargs) -> None:
        ids_BS = kwargs.get("input_ids", args[0] if args else None)
        if ids_BS is None:
            raise ArgumentError("routing replay records generation from input_ids; this forward was given none")
        self._shape = tuple(ids_BS.shape)
        if not self._steps:
            self.prompt_len = self._shape[1]  # the first forward is the whole (left-padded) prompt
        if self._last_logp_BV is not None:  # this step's input is the token the last step drew
            self._logps.append(self._last_logp_BV.gather(1, ids_BS[:, -1:].to(self._last_logp_BV.device)).squeeze(1))
        self._steps.append([None] * len(self.layers))

    def _on_router(self, call: RouterCall) -> None:
        logits_TE, _, ids_TK = call.read()
        if self.facts is not None:
            ids_TK = chosen_experts(call.layer, self.facts, call.output)
        B, S = self._shape
        if ids_TK is None or ids_TK.shape[0] != B * S:
            raise ArgumentError(
                f"router {call.layer.name} chose {None if ids_TK is None else tuple(ids_TK.shape)} for a forward of "
                f"{B} x {S} tokens: routing replay needs each token's top-k"
            )
        dtype = route_dtype(logits_TE.shape[-1])
        self._steps[-1][call.pos] = ids_TK.detach().reshape(B, S, -1).to(dtype).cpu()

    def _on_outputs(self, output) -> None:
        logits = output.logits if hasattr(output, "logits") else output[0]
        self._last_logp_BV = torch.log_softmax(logits[:, -1, :].float() / self.temperature, dim=-1).cpu()

    # ---- what was recorded ----------------------------------------------------------
    @property
    def routes_BSLK(self) -> torch.Tensor:
        """Every forwarded position's top-k in each MoE layer, generation's padded layout (``P + C - 1`` positions
        for ``C`` generated tokens)."""
        if not self._steps:
            raise ArgumentError("nothing was recorded: no forward ran inside the recorder")
        missing = [pos for pos, ids in enumerate(self._steps[0]) if ids is None]
        if missing:
            raise ArgumentError(f"MoE layers {missing} were not called in the recorded forwards")
        per_layer = [torch.cat([step[pos] for step in self._steps], dim=1) for pos in range(len(self.layers))]
        return torch.stack(per_layer, dim=2)

    def logps(self, sequences_BN: torch.Tensor) -> torch.Tensor:
        """``logps_BC``: the log-probability of each generated token under the sampling distribution (raw logits /
        temperature), ``sequences_BN`` being what ``generate`` returned (its last ``C`` tokens generated)."""
        if self._last_logp_BV is None:
            raise ArgumentError("nothing was recorded: no forward ran inside the recorder")
        last_B = self._last_logp_BV.gather(1, sequences_BN[:, -1:].cpu()).squeeze(1)
        return torch.stack([*self._logps, last_B], dim=1)
