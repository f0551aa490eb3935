"""Installing an anchor into a Hugging Face MoE model, reversibly.

Every router gets one forward hook (``rpb.observe``). In train mode the hook may replace the router's
``(logits, gates, topk_ids)`` output with a biased or forced selection (gates always from
the unbiased logits) and records the anchor's loss term for the layer; in eval mode, or
with no step context set, it returns the native output untouched. Hooks leave module
identities and parameter names alone, so a checkpoint saved while installed is a plain
HF checkpoint; ``remove()`` drops the hooks and restores what was changed
(``requires_grad`` for router-freeze, ``output_router_logits``).

Usage inside any training loop::

    handle = install_anchor(model, AnchorConfig(method="rpb"), prior=artifact.prior_qa)
    with handle.step(sample_index_BT, span_BT, attention_mask_BT):
        loss = model(**batch).loss + handle.loss()
        loss.backward()          # inside the block: recomputation sees the same bias
    handle.remove()
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass, field

import torch
from torch import nn

from rpb.adapters import (
    MoELayer,
    RouterFacts,
    UnsupportedModelError,
    find_moe_layers,
    get_adapter,
    router_spec,
)
from rpb.adapters.hf import expert_bias_of
from rpb.anchors.base_state import base_into
from rpb.anchors.config import AnchorConfig
from rpb.anchors.context import TokenContext
from rpb.anchors.methods import Method, RouterState, get_method
from rpb.anchors.overlap import OverlapCounts
from rpb.anchors.prior_routing import PriorRouting
from rpb.anchors.stats import LayerStats
from rpb.errors import ArgumentError
from rpb.observe.hooks import Hooks, RouterCall, on_router_calls
from rpb.prior import family_transform
from rpb.routing import RouterSpec, combine_weights, select_with_groups


@dataclass
class _Layer:
    moe: MoELayer
    spec: RouterSpec
    expert_bias_E: torch.Tensor | None
    base_weight_EH: torch.Tensor | None = None  # frozen float32 copy, kept unsharded
    base_bias_E: torch.Tensor | None = None  # the router's own bias (gpt-oss), frozen float32 copy

    def base_logits(self, hidden_TH: torch.Tensor) -> torch.Tensor:
        """The frozen base router's logits on ``hidden_TH`` (float32), its bias included where it has one."""
        return nn.functional.linear(hidden_TH, self.base_weight_EH, self.base_bias_E)


@dataclass
class AnchorHandle:
    model: nn.Module
    config: AnchorConfig
    method: Method
    facts: RouterFacts
    layers: list[_Layer]
    prior: PriorRouting | None = None
    record_stats: bool = False
    #: apply the anchor in eval mode too (``applied_in_eval``); training never needs it
    _in_eval: bool = False
    #: the model config's ``output_router_logits`` before installing (None: the config has none)
    native_output_router_logits: bool | None = None
    _context: TokenContext | None = None
    _terms: dict = field(default_factory=dict)
    stats: dict = field(default_factory=dict)
    _hooks: Hooks = field(default_factory=Hooks)
    _restore: list = field(default_factory=list)
    #: callables ``tap(pos, hidden, logits_TE, native_ids_TK)`` the hook hands each training-mode router call
    #: (recomputations aside): observers such as ``rpb.monitor`` read the routers through the anchor's taps
    taps: list = field(default_factory=list)
    #: inside ``unobserved()``: forwards the taps and the statistics leave out
    _unobserved: bool = False
    #: routing-kd / output-kd: where the base's routing comes from (``rpb.teacher``: ``OnlineBase`` or
    #: ``StoredRoutes``; ``rpb.train.run.attach_anchor`` sets it), None for the other methods
    teacher: object | None = None
    #: routing-kd: the optimizer step's routing overlap with the base, counted by the hook (``rpb.anchors.overlap``)
    overlap: OverlapCounts | None = None
    #: the coefficient a routing target's controller set for this step (None: the configuration's)
    lambda_now: float | None = None

    # ---- step context --------------------------------------------------------------
    @contextlib.contextmanager
    def step(
        self,
        sample_BT: torch.Tensor,
        span_BT: torch.Tensor,
        attention_mask_BT: torch.Tensor | None = None,
        weight_BT: torch.Tensor | None = None,
    ):
        """Set the per-token context for one step; keep the block open until backward is done. ``weight_BT``:
        each token's weight in the token terms' mean (summing to 1; None: every valid token alike)."""
        self._context = TokenContext.from_batch(sample_BT, span_BT, attention_mask_BT)
        if weight_BT is not None:
            self._context.weight_T = weight_BT.reshape(-1)
        self._terms = {}
        try:
            yield self._context
        finally:
            self._context = None
            self._terms = {}

    @contextlib.contextmanager
    def applied_in_eval(self):
        """Apply the anchor to eval-mode forwards as training would (``rpb calibrate``: the frozen base,
        no dropout, no router jitter); outside the block eval mode never sees the bias."""
        self._in_eval = True
        try:
            yield self
        finally:
            self._in_eval = False

    @contextlib.contextmanager
    def unobserved(self):
        """Forwards inside the block are anchored as training's are, but no tap (``rpb.monitor``) and no statistic
        counts them: a forward that scores rollouts (GRPO's old log-probabilities) is no training forward."""
        was, self._unobserved = self._unobserved, True
        try:
            yield self
        finally:
            self._unobserved = was

    def base_routing(self, inputs: dict, sample_BT: torch.Tensor):
        """The base's routing of a batch (``rpb.teacher.BaseRouting``) for ``TokenContext.base``: the online base's
        forward on ``inputs`` (the batch as the model takes it, on its device), or the stored routes of the tokens'
        rows (``sample_BT``). None without a teacher."""
        if self.teacher is None:
            return None
        if getattr(self.teacher, "by_rows", False):  # stored routes: the rows and positions say which
            return self.teacher.step(sample_BT)
        if self.method.loss is not None and "base_hidden" in self.method.loss.reads:  # hidden-kd
            return self.teacher.step(inputs, hidden=True)
        return self.teacher.step(inputs)

    def loss(self) -> torch.Tensor:
        """The anchor's loss term for the last forward (coefficient applied; 0 for none)."""
        if not self._terms:
            return torch.zeros((), device=self._device())
        term = self.coefficient() * torch.stack([self._terms[i] for i in sorted(self._terms)]).mean()
        trainable = any(layer.moe.trainable for layer in self.layers)
        if torch.is_grad_enabled() and trainable and not term.requires_grad:
            raise RuntimeError(
                f"{self.method.name}: the routers ran without gradients in this step, so the anchor's loss term "
                "cannot train them; with gradient checkpointing use "
                'gradient_checkpointing_kwargs={"use_reentrant": False}'
            )
        return term

    def coefficient(self) -> float | None:
        """The loss term's coefficient this step: a routing target's λ where one steers it, else the config's."""
        return self.lambda_now if self.lambda_now is not None else self.config.coefficient()

    @property
    def router_transform(self) -> str:
        """The transform ``kl-to-base`` (and a monitor reading this anchor) reads the routers with:
        ``config.router_transform`` (``rpb train`` resolves the prior's into it), else the family's."""
        return self.config.router_transform or family_transform(self.facts.score_function)

    def _device(self) -> torch.device:
        return self.layers[0].moe.router.weight.device

    # ---- the hook ------------------------------------------------------------------
    def _hook(self, call: RouterCall):
        """One router call (``rpb.observe``): None keeps the native output, a triple replaces it."""
        pos, module, hidden = call.pos, call.module, call.hidden
        layer = self.layers[pos]
        idle = self.prior is None and self.method.loss is None
        ctx = self._context
        if not (module.training or self._in_eval) or ctx is None or (idle and not (self.record_stats or self.taps)):
            return None
        logits_TE, native_gates_TK, native_ids_TK = call.read()
        if native_ids_TK is None:
            raise UnsupportedModelError(f"router {layer.moe.name} returns no expert selection to anchor")
        if logits_TE.shape[0] != ctx.num_tokens:
            raise RuntimeError(
                f"router {layer.moe.name} saw {logits_TE.shape[0]} tokens but the step context holds "
                f"{ctx.num_tokens}; pass the batch's own sample index and span tensors"
            )
        # a forward recomputed during backward (checkpointing) routes alike but records nothing twice
        first_call = ("recorded", pos) not in ctx.cache
        ctx.cache[("recorded", pos)] = True
        if first_call and not self._unobserved:
            for tap in self.taps:
                tap(pos, hidden, logits_TE, native_ids_TK)
        valid_T = ctx.valid_T.to(logits_TE.device)
        term = active_T = None
        if self.method.loss is not None:
            # computed on every call, so a recomputed forward saves exactly what the first one did
            # (non-reentrant checkpointing checks that); only the first call's term is kept
            weight_T = valid_T if ctx.weight_T is None else ctx.weight_T.to(logits_TE.device)
            term, active_T = self._loss_term(layer, module, hidden, logits_TE, weight_T)
            if first_call:
                self._terms[pos] = term
            if first_call and self.overlap is not None and not self._unobserved and ctx.base is not None:
                self.overlap.count(pos, ctx.base, layer.spec, layer.expert_bias_E, native_ids_TK, weight_T)
        gates_TK, ids_TK = native_gates_TK, native_ids_TK
        if self.prior is not None:
            gates_TK, ids_TK = self._prior_selection(pos, logits_TE, ctx, native_gates_TK, native_ids_TK)
        if first_call and self.record_stats and not self._unobserved:
            self._record(pos, ids_TK, native_ids_TK, valid_T, ctx.content_T.to(valid_T.device), term, hidden)
            if active_T is not None:  # the ids-alone hinge: the share of tokens where it is active
                self.stats[pos].hinge_active += int(active_T.sum())
                self.stats[pos].hinge_tokens += int(valid_T.sum())
        if self.prior is None:
            return None
        return logits_TE, gates_TK, ids_TK

    def prior_choice(self, pos: int, logits_TE: torch.Tensor, ctx: TokenContext):
        """``(ids_TK, kept_TG)``: the experts the prior picks for every token of MoE layer ``pos`` -- soft:
        the model's own selection on ``z + beta * b`` (and, for group-limited routers, the groups it
        keeps); hard: the prior's top-k (no groups) -- before structural and padding tokens are given
        their native choice back. Training and ``rpb calibrate`` read the very same choice."""
        layer = self.layers[pos]
        tables = self.prior.tables(ctx, logits_TE.device)
        if tables.bias_PLE is not None:
            bias_TE = tables.bias_PLE[tables.pair_T, pos] * tables.content_T[:, None]
            # added in float32: a bf16 bias would round b before it chooses (spacing ~0.03 near 4)
            return select_with_groups(logits_TE, layer.spec, bias_TE.float(), layer.expert_bias_E)
        return tables.topk_PLK[tables.pair_T, pos], None

    def _prior_selection(self, pos: int, logits_TE, ctx, native_gates_TK, native_ids_TK):
        layer = self.layers[pos]
        content_T1 = self.prior.tables(ctx, logits_TE.device).content_T[:, None]
        ids_TK, _ = self.prior_choice(pos, logits_TE, ctx)
        gates_TK = combine_weights(logits_TE, ids_TK, layer.spec)
        # structural and padding tokens keep exactly what the native router chose and weighted
        ids_TK = torch.where(content_T1, ids_TK, native_ids_TK)
        gates_TK = torch.where(content_T1, gates_TK.to(native_gates_TK.dtype), native_gates_TK)
        return gates_TK, ids_TK

    def _loss_term(self, layer: _Layer, module, hidden, logits_TE, valid_T):
        """``(term, active_T)``: the layer's term, and the tokens where a term that says so is active."""
        reads = self.method.loss.reads
        state = RouterState(layer.spec.score_function, layer.spec.top_k, self.router_transform)
        if reads & {"logits", "base_logits", "hidden"}:
            state.logits_TE, state.valid_T = logits_TE, valid_T
        if "detached_logits" in reads:  # the router-only control: the router's own weights on its input, detached
            bias = getattr(module, self.facts.router_bias) if self.facts.router_bias else None
            hidden_TH = hidden.reshape(-1, hidden.shape[-1]).detach().float()
            state.logits_TE = nn.functional.linear(hidden_TH, module.weight.float(), _float(bias))
            state.valid_T = valid_T
        if "hidden" in reads:
            state.hidden_TH = hidden.reshape(-1, hidden.shape[-1])
        if "base_logits" in reads:
            hidden_TH = hidden.reshape(-1, hidden.shape[-1]).float()
            state.base_logits_TE = layer.base_logits(hidden_TH)
        if reads & {"base_routing", "base_hidden"}:
            self._base_routing_into(state, layer, logits_TE)
            state.spec, state.expert_bias_E = layer.spec, layer.expert_bias_E
        if "weights" in reads:
            state.weights = ((module.weight, layer.base_weight_EH),)
            if layer.base_bias_E is not None:
                state.weights += ((getattr(module, self.facts.router_bias), layer.base_bias_E),)
        term = self.method.loss.term(state)
        return term, state.active_T

    def _base_routing_into(self, state: RouterState, layer: _Layer, logits_TE: torch.Tensor) -> None:
        pos = next(i for i, lay in enumerate(self.layers) if lay is layer)
        base_into(state, self._context.base, pos, self.method, self.config.routes_loss, layer.moe.name, logits_TE)

    @torch.no_grad()
    def _record(self, pos: int, ids_TK, native_ids_TK, valid_T, content_T, term, hidden) -> None:
        """Add one step's counts for MoE layer ``pos`` (``rpb.anchors.stats``)."""
        layer = self.layers[pos]
        E = layer.spec.num_experts
        s = self.stats.get(pos) or LayerStats(load_E=torch.zeros(E), top_k=layer.spec.top_k)
        changed_T = (ids_TK.sort(dim=-1).values != native_ids_TK.sort(dim=-1).values).any(dim=-1) & content_T
        s.tokens += int(valid_T.sum())
        s.content += int(content_T.sum())
        s.changed += int(changed_T.sum())
        s.load_E += torch.bincount(ids_TK[valid_T].reshape(-1), minlength=E).float().cpu()
        if term is not None:
            s.term_sum += float(self.coefficient() * term.detach())
            s.term_steps += 1
        if layer.base_weight_EH is not None:
            # the current router's own choice against the base router's, both on the current hidden states
            hidden_TH = hidden.reshape(-1, hidden.shape[-1]).float()
            base_TE = layer.base_logits(hidden_TH)
            base_ids_TK, _ = select_with_groups(base_TE, layer.spec, expert_bias_E=layer.expert_bias_E)
            shared_T = (native_ids_TK[:, :, None] == base_ids_TK[:, None, :]).any(-1).sum(-1)
            s.overlap += int(shared_T[valid_T].sum())
            s.overlap_tokens += int(valid_T.sum())
        self.stats[pos] = s

    def reset_stats(self) -> dict:
        """Return the statistics accumulated since the last reset, and start afresh."""
        out, self.stats = self.stats, {}
        return out

    # ---- removal -------------------------------------------------------------------
    def reinstall(self, model: nn.Module) -> AnchorHandle:
        """The same anchor (method, prior, permutations, base) moved onto ``model``, e.g. the ``PeftModel``
        that wrapped this one's model after installation (PEFT replaces or copies routers). A frozen copy taken
        as the online base gives way to the wrapped model with its adapters disabled (axolotl, TRL's
        ``peft_config``: they wrap after the anchor is attached)."""
        self.remove()
        prior = self.prior
        handle = install_anchor(
            model,
            self.config,
            prior=prior.pi_NSLE if prior else None,
            sigma_LE=prior.sigma_LE if prior else None,
            adapter=self.facts.model_type,
            record_stats=self.record_stats,
        )
        handle.teacher = self.teacher
        if getattr(self.teacher, "mode", None) == "frozen-copy":
            from rpb.teacher.online import OnlineBase, is_peft

            if is_peft(model):  # wrapped with adapters after the base was taken: disabling them gives the base
                handle.teacher = OnlineBase("adapters-off", self.facts, model, self.teacher.outputs)
        return handle

    def remove(self) -> None:
        self._hooks.remove()
        for restore in reversed(self._restore):
            restore()
        self._restore = []


def _float(t: torch.Tensor | None) -> torch.Tensor | None:
    return None if t is None else t.float()


def install_anchor(
    model: nn.Module,
    config: AnchorConfig,
    prior: torch.Tensor | None = None,
    sigma_LE: torch.Tensor | None = None,
    adapter: str | None = None,
    record_stats: bool = False,
) -> AnchorHandle:
    """Install ``config.method`` into every router of ``model``; returns the handle.

    ``prior`` is ``pi`` [N, 2, L, E] (required by the prior-based methods; check it first
    with ``rpb.anchors.verify_prior``); ``sigma_LE`` the per-layer expert permutation of
    the shuffled controls (see ``rpb.anchors.controls``).
    """
    problems = config.problems()
    if problems:
        raise ArgumentError("invalid anchor configuration:\n  " + "\n  ".join(problems))
    method = get_method(config.method)
    facts = get_adapter(adapter or model.config.model_type)
    moe_layers = find_moe_layers(model, facts)
    if method.loss is not None and not method.loss.from_forward and not any(m.trainable for m in moe_layers):
        # a term on the router weights alone has no gradient to give when they cannot move
        raise ArgumentError(
            f"method {method.name!r} constrains the router weights, but no router of this model can train "
            "(frozen, or outside the LoRA targets): it would add a constant. Train the routers (LoRA on the "
            "router, or the router in full), or use kl-to-base / logit-l2, which act through the layers below"
        )
    if method.loss is not None and "detached_logits" in method.loss.reads and not any(m.trainable for m in moe_layers):
        raise ArgumentError(
            f"method {method.name!r} sends its gradient to the routers' weights alone, and no router of this model "
            "can train (under LoRA the routers are frozen): it would train nothing. Use it under full fine-tuning"
        )
    layers = []
    for m in moe_layers:
        bias = expert_bias_of(m, facts)
        base = m.router.weight.detach().float().clone() if method.needs_base_router else None
        base_bias = None
        if method.needs_base_router and facts.router_bias is not None:
            base_bias = getattr(m.router, facts.router_bias).detach().float().clone()
        layers.append(_Layer(m, router_spec(m.router, facts), bias, base, base_bias))

    routing = None
    if method.needs_prior:
        if prior is None:
            raise ArgumentError(f"method {method.name!r} needs the prior (pi, [samples, 2, MoE layers, experts])")
        if prior.dim() != 4 or prior.shape[2:] != (len(layers), layers[0].spec.num_experts):
            raise ArgumentError(
                f"prior of shape {tuple(prior.shape)} does not fit the model's {len(layers)} MoE layers x "
                f"{layers[0].spec.num_experts} experts"
            )
        if method.shuffle is not None and sigma_LE is None:
            raise ArgumentError(f"method {method.name!r} needs sigma_LE, the per-layer expert permutation")
        routing = PriorRouting(
            prior,
            method.selection,
            top_k=layers[0].spec.top_k,
            beta=config.beta,
            eps=config.eps,
            clip=config.c,
            sigma_LE=sigma_LE if method.shuffle else None,
        )

    handle = AnchorHandle(model, config, method, facts, layers, routing, record_stats)
    if method.teacher == "routing":
        handle.overlap = OverlapCounts(len(layers))
    if hasattr(model.config, "output_router_logits"):
        # no native auxiliary loss under any method: lbl computes its own
        old = handle.native_output_router_logits = model.config.output_router_logits
        model.config.output_router_logits = False
        handle._restore.append(lambda: setattr(model.config, "output_router_logits", old))
    if method.freeze_router:
        for layer in layers:
            w = layer.moe.router.weight
            handle._restore.append(lambda w=w, flag=w.requires_grad: w.requires_grad_(flag))
            w.requires_grad_(False)
    handle._hooks = on_router_calls([lay.moe for lay in layers], handle._hook, replaces=True)
    return handle
