"""Recording a rollout as ``model.generate`` makes it: each MoE layer's top-k at every forwarded position, and the
log-probability of every generated token.

Shape legend: B = rollouts, P = the left-padded prompt's length, S = forwarded positions, s = one forward's
positions, L = MoE layers, K = top-k, C = generated tokens, V = vocabulary.

**Where a forward's routes go.** Each forward covers positions ``offset .. offset + s - 1`` of generation's own
padded layout, where ``offset`` is what the model has already seen: the attention mask's length minus the
forward's (``generate`` always hands the mask of the whole sequence so far), else the cache's length, else 0.
That one rule places every generation path: with a KV cache (the prompt once, then one token a step), without
one (every step forwards the whole sequence again), and with chunked prefill (the prompt in pieces). A position
forwarded twice keeps the route of its first forward, as an engine with prefix caching returns it; a position
forwarded again with another token (speculative decoding, a rolled-back cache), or a forward that starts past
what was recorded (a cache filled before the recorder), cannot be placed: the recorder then says why
(``problem``) and ``routes_BSLK`` refuses, naming it, rather than hand out routes at the wrong positions.

The last generated token is never forwarded, so it has no route (engines say the same): ``routes_BSLK`` covers
positions ``0 .. P + C - 2`` (pad positions included: ``rollout_routes`` keeps the real tokens' alone).

**Log-probabilities** are read from the raw logits at each forward's last position divided by the sampling
temperature, before any warper (top-k, top-p), as an engine reports its sampling log-probabilities; the row
waits on the device until the next forward's input says which token was drawn, then only that token's value is
kept, so memory stays ``B x V`` and nothing of size ``V`` leaves the device.

Everything recorded stays on the device until it is read (``routes_BSLK``, ``logps``): one transfer per
generation, not one per router call.
"""

from __future__ import annotations

import torch

from rpb.adapters import MoELayer, RouterFacts, chosen_experts
from rpb.errors import ArgumentError
from rpb.observe.hooks import Hooks, RouterCall, on_model_inputs, on_model_outputs, on_router_calls
from rpb.replay.routes import route_dtype


def forward_offset(ids_Bs: torch.Tensor, kwargs: dict) -> int:
    """The first position a generation forward covers: the 2-D attention mask's length minus the forward's,
    else the cache's length (a compiled cache's 4-D mask spans the cache's capacity, not what it holds),
    else 0."""
    mask = kwargs.get("attention_mask")
    if isinstance(mask, torch.Tensor) and mask.dim() == 2:
        return int(mask.shape[1]) - int(ids_Bs.shape[1])
    cache = kwargs.get("past_key_values", kwargs.get("cache"))
    if cache is not None and callable(getattr(cache, "get_seq_length", None)):
        return int(cache.get_seq_length())
    return 0


class GenerationRecorder:
    """``with GenerationRecorder(model, layers, temperature) as rec: out = model.generate(...)``, then
    ``rec.routes_BSLK`` and ``rec.logps(out_ids)``. ``model`` is the module ``generate`` forwards (the causal LM,
    under any PEFT wrapper), ``layers`` its MoE layers (``rpb.adapters.find_moe_layers``). ``facts``: the family,
    for routers that return their logits alone (the MoE block selects): their selection is the family's own
    (``rpb.adapters.chosen_experts``); without it such a router is refused. ``logps=False`` records routes alone
    (a model without a language-model head: ``rpb routes``)."""

    def __init__(
        self,
        model: torch.nn.Module,
        layers: list[MoELayer],
        temperature: float = 1.0,
        facts: RouterFacts | None = None,
        logps: bool = True,
    ):
        if temperature <= 0:
            raise ArgumentError(f"temperature={temperature}: the log-probabilities need a positive temperature")
        self.model, self.layers, self.temperature, self.facts = model, layers, float(temperature), facts
        self.record_logps = logps
        self._hooks = Hooks()
        self._reset()

    def _reset(self) -> None:
        #: why the routes cannot be placed (None: they can)
        self.problem: str | None = None
        #: P when the prefill ran in one forward: the first forward's end (pass the real P to ``logps`` otherwise)
        self.prompt_len = 0
        self._filled = 0  # positions 0 .. _filled - 1 hold a route
        self._forward: tuple | None = None  # (B, s, offset, its first new position, whether it has new ones)
        self._pieces: list[tuple[int, list[torch.Tensor | None]]] = []  # (start, each layer's ids [B, new, K])
        self._tokens: list[torch.Tensor] = []  # the token ids of the recorded positions, in pieces [B, new]
        self._logp: dict[int, torch.Tensor] = {}  # position -> the log-probability of its token [B]
        self._next: tuple[int, torch.Tensor] | None = None  # (position, log-softmax row [B, V]) awaiting its token

    def __enter__(self) -> GenerationRecorder:
        self._reset()
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
        ids_Bs = kwargs.get("input_ids", args[0] if args else None)
        if ids_Bs is None:
            raise ArgumentError("routing replay records generation from input_ids; this forward was given none")
        B, s = ids_Bs.shape[:2]
        offset = forward_offset(ids_Bs, kwargs)
        if self.problem is None and offset > self._filled:
            self.problem = (
                f"a forward starting at position {offset} while positions up to {self._filled - 1} were recorded: "
                f"positions {self._filled}..{offset - 1} were forwarded outside the recorder (a cache filled "
                "before generation, or continued from another call)"
            )
        if self.problem is None and offset < self._filled:
            # positions forwarded again: they keep their first route, and must hold the same tokens
            seen_Bs = torch.cat(self._tokens, dim=1)[:, offset : min(offset + s, self._filled)]
            if not torch.equal(seen_Bs, ids_Bs[:, : seen_Bs.shape[1]].to(seen_Bs.device)):
                self.problem = (
                    f"positions {offset}..{offset + seen_Bs.shape[1] - 1} were forwarded again with other tokens "
                    "(speculative or assisted decoding, a rolled-back cache): their routes belong to no one token"
                )
        if not self._pieces and not self._tokens:
            self.prompt_len = offset + s
        if self._next is not None and self.record_logps:
            pos, logp_BV = self._next
            if offset <= pos < offset + s and pos not in self._logp:  # this forward holds the drawn token
                drawn_B1 = ids_Bs[:, pos - offset, None].to(logp_BV.device)
                self._logp[pos] = logp_BV.gather(1, drawn_B1).squeeze(1)
            self._next = None
        start, new = max(offset, self._filled), self.problem is None and offset + s > self._filled
        self._forward = (B, s, offset, start, new)
        if new:
            self._tokens.append(ids_Bs[:, start - offset :].detach())
            self._pieces.append((start, [None] * len(self.layers)))
            self._filled = offset + s

    def _on_router(self, call: RouterCall) -> None:
        logits_TE, _, ids_TK = call.read()
        if self.facts is not None:
            ids_TK = chosen_experts(call.layer, self.facts, call.output)
        B, s, offset, start, new = self._forward
        if ids_TK is None or ids_TK.shape[0] != B * s:
            raise ArgumentError(
                f"router {call.layer.name} chose {None if ids_TK is None else tuple(ids_TK.shape)} for a forward of "
                f"{B} x {s} tokens: routing replay needs each token's top-k"
            )
        if not new or self.problem is not None:
            return  # nothing new in this forward (every position was recorded before), or nothing placeable
        dtype = route_dtype(logits_TE.shape[-1])
        self._pieces[-1][1][call.pos] = ids_TK.detach().reshape(B, s, -1)[:, start - offset :].to(dtype)

    def _on_outputs(self, output) -> None:
        if not self.record_logps:
            return
        logits = output.logits if hasattr(output, "logits") else output[0]
        _, s, offset, _, _ = self._forward
        logp_BV = torch.log_softmax(logits[:, -1, :].detach().float() / self.temperature, dim=-1)
        self._next = (offset + s, logp_BV)

    # ---- what was recorded ----------------------------------------------------------
    @property
    def routes_BSLK(self) -> torch.Tensor:
        """Every forwarded position's top-k in each MoE layer, generation's padded layout (``P + C - 1`` positions
        for ``C`` generated tokens), on the host."""
        if self.problem is not None:
            raise ArgumentError(f"routes that cannot be placed: {self.problem}")
        if not self._pieces:
            raise ArgumentError("nothing was recorded: no forward ran inside the recorder")
        missing = sorted({pos for _, ids in self._pieces for pos, t in enumerate(ids) if t is None})
        if missing:
            raise ArgumentError(f"MoE layers {missing} were not called in the recorded forwards")
        per_layer = [torch.cat([ids[pos] for _, ids in self._pieces], dim=1) for pos in range(len(self.layers))]
        return torch.stack(per_layer, dim=2).cpu()

    def logps(self, sequences_BN: torch.Tensor, prompt_len: int | None = None) -> torch.Tensor:
        """``logps_BC``: the log-probability of each generated token under the sampling distribution (raw logits /
        temperature), on the host. ``sequences_BN``: what ``generate`` returned, or any ``[B, >= 1]`` whose last
        column is each row's last generated token (the one never forwarded); ``prompt_len``: P, the padded
        prompt's length (default: the first forward's end, right when the prefill ran in one forward). NaN
        where a token's value was never seen."""
        if self._next is None and not self._logp:
            raise ArgumentError("nothing was recorded: no forward ran inside the recorder")
        P = self.prompt_len if prompt_len is None else int(prompt_len)
        last, logp_BV = self._next if self._next is not None else (self._filled, None)
        B = sequences_BN.shape[0]
        device = logp_BV.device if logp_BV is not None else next(iter(self._logp.values())).device
        nan_B = torch.full((B,), float("nan"), device=device)
        cols = [self._logp.get(pos, nan_B) for pos in range(P, last)]
        if logp_BV is not None:
            cols.append(logp_BV.gather(1, sequences_BN[:, -1:].to(device)).squeeze(1))
        return torch.stack(cols, dim=1).cpu() if cols else torch.zeros((B, 0))
