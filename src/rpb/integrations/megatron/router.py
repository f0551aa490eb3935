"""Installing an anchor into every Megatron-Core ``TopKRouter`` of a built model, reversibly.

Shape legend: T = router rows (``position * micro_batch + batch_index``), E = routed experts,
K = top-k, B = micro-batch rows, S = sequence positions, P / L as in ``rpb.anchors.prior_routing``.

Where it hooks. ``TopKRouter.forward`` runs ``gating`` (the router linear; it also moves the
weight to CUDA) and then ``routing(logits, padding_mask)``, which calls the module-level
``topk_routing_with_score_function`` with ``router_replay=self.router_replay``. The anchor
replaces ``routing`` on each router *instance* (an instance attribute that shadows the
class method; ``remove()`` deletes it), and inside it:

1. picks the experts with Megatron's own ``topk_routing_with_score_function`` -- the score
   function, pre-softmax, the (frozen) expert bias, group-limited top-k -- run on
   ``z + beta * b`` in float32 (soft anchors) or takes the prior's top-k (hard anchors);
   structural and padding tokens keep the selection made on the unbiased ``z``;
2. calls the original ``routing`` with ``router_replay`` set, for that one call, to an object
   that hands Megatron those indices. Megatron then computes everything else itself, from
   the unbiased logits: the combine weights (softmax over the selected logits, the selected
   pre-softmax / sigmoid scores, their normalisation and the top-k scaling factor), token
   dropping, auxiliary losses, z-loss and the expert-bias token counts.

``router_replay`` is the hook Megatron added for replaying a recorded routing; it exists from
megatron-core 0.16 on, and newer releases still pass it (they also accept
``precomputed_indices``, which this integration does not need). ``topk_hook`` drives it. Installing
refuses any router whose routing would bypass it: the fused router (``moe_router_fusion``),
sinkhorn or quantile balancing. Megatron's own routing replay (``moe_enable_routing_replay``) uses
the same hook, so it and a selection anchor exclude each other (``topk_hook.forced_topk`` refuses an
active one); the loss anchors leave the hook to it (docs/megatron.md, "Routing replay").

In eval mode, or with no micro-batch context set, the original ``routing`` runs untouched.
The context stays set until the next micro-batch or ``clear()``, so activation recomputation
during backward routes alike. Pipeline parallelism (micro-batches interleave their forward
and backward passes) and context parallelism are refused; the paper used neither.

The loss-based anchors and ``router-freeze`` keep Megatron's own selection (a routing replay's
recorded one, when Megatron replays). A loss anchor's term is the methods table's own
(``Method.loss.term``, the same function the HF hook calls), fed the same ``RouterState``:

* terms that read the step's forward (``lbl``, ``kl-to-base``, ``logit-l2``) are recorded in
  ``routing``: the router's logits, and for the base-logit terms ``linear(x, W_base)`` in
  float32 on the router input ``x`` that ``gating`` receives (after any input jitter; ``gating``
  is wrapped on the instance only to hand that input to ``routing``);
* terms that read the weights alone (``router-l2``) are computed in ``loss()``, so they reach
  the weights under any activation recomputation. ``W_base`` is a float32 copy taken at install
  on the router's device; Megatron's router weight is a full ``[E, H]`` parameter on every TP
  rank (replicated, never sharded), and a router built with ``add_bias_linear`` has a gating
  bias, anchored like its weight (HF routers have none);
* ``router-freeze``: every router parameter gets ``requires_grad=False`` until ``remove()``.
  Megatron's DDP and optimizer take the trainable parameters when they wrap the model, so
  freeze before that (``freeze_router_parameters`` as a Bridge pre-wrap hook); a router
  parameter that already has Megatron's ``main_grad`` buffer is refused.

``lbl`` is the HF path's term (Megatron's ``aux_loss`` form on sigmoid routers, transformers'
form, ``k`` times Megatron's, on softmax ones), not Megatron's native auxiliary loss, which must
be off (``moe_aux_loss_coeff=0``, else it would count twice).

Which tokens count: as on the HF path, every token that is not padding (sample -1), structural
ones included, and also not marked by Megatron's padding mask; each term is a mean over them.
The terms are recorded in ``routing`` (train mode, context set) and ``handle.loss()`` returns
``coef * mean over routers``; a Megatron loss function adds it (see ``bridge.anchored_loss``).

Tensor parallelism. Without sequence parallelism every TP rank routes the whole micro-batch and
keeps its own (identical) router gradient, so ``loss()`` is the whole term. With it, each rank
routes its sequence shard, and Megatron sums the router's gradients over the TP group (the
weight is marked ``sequence_parallel``): each rank gathers the micro-batch's rows (all-gather
forward, reduce-scatter backward), computes the whole term and returns ``1 / tp`` of it, so the
ranks' shares add up to the HF term and their gradients to its gradient (``loss_shares`` says
how many shares there are, for logging the whole value).

``routing-kd`` runs here from stored routes (``anchor.base: routes``): the base's top-k per token (and its
probabilities there, where the route file holds them) are handed in with each micro-batch
(``set_micro_batch(..., base_ids_BSLK=, base_probs_BSLK=)``, ``[B, S, MoE layers, K]`` as
``rpb.teacher.StoredRoutes.routes_BSLK`` reads them from the route file), laid out as each router's rows; the
term is the HF path's (``Method.loss.term``). Under sequence parallelism they are laid out whole, in the order
the gathered rows take. The online base (a second model's forward) is not built here: refused at install.

The terms built from the forward need the router's forward to run with gradients: Megatron's
reentrant recomputation of whole layers (``recompute_granularity="full"``) or of the MoE layer
(``recompute_modules`` with ``"moe"``) runs the first forward without them, so those settings
are refused for these methods (``install.py``).
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from dataclasses import dataclass, field

import torch
from torch import nn

from rpb.anchors.config import AnchorConfig
from rpb.anchors.context import TokenContext
from rpb.anchors.methods import Method, RouterState, take_stored
from rpb.anchors.prior_routing import PriorRouting
from rpb.errors import RpbError
from rpb.integrations.megatron.figures import RoutingFigures
from rpb.integrations.megatron.layout import router_rows, stored_rows

# topk_routing_function is re-exported: install.py imports it from here
from rpb.integrations.megatron.topk_hook import (  # noqa: F401
    forced_topk,
    megatron_select,
    selection_spec,
    topk_routing_function,
)
from rpb.losses import routes_loss_form
from rpb.prior import STRUCTURAL, family_transform
from rpb.teacher.routing import BaseRouting


class MegatronAnchorError(RpbError):
    def __init__(self, problems: list[str]):
        self.problems = problems
        super().__init__(
            f"cannot install the anchor into this Megatron-Core model ({len(problems)} problem(s)):\n"
            + "\n".join(f"  - {p}" for p in problems)
        )


@dataclass
class MegatronRouter:
    """One installed router: its position in the prior's layer axis and its global layer number.

    ``base_weight_EH`` / ``base_bias_E``: the router's weight (and gating bias, if it has one) as
    installed, float32 and frozen; kept only for the methods that compare with the base router.
    """

    pos: int
    name: str
    module: nn.Module
    layer_number: int
    base_weight_EH: torch.Tensor | None = None
    base_bias_E: torch.Tensor | None = None

    @property
    def hf_layer_index(self) -> int:
        """The 0-based decoder-layer index (Megatron numbers layers from 1)."""
        return self.layer_number - 1

    def base_on(self, device: torch.device) -> tuple[torch.Tensor, torch.Tensor | None]:
        """The base copies on ``device`` (``gating`` may move the weights to CUDA after install)."""
        if self.base_weight_EH.device != device:
            self.base_weight_EH = self.base_weight_EH.to(device)
            if self.base_bias_E is not None:
                self.base_bias_E = self.base_bias_E.to(device)
        return self.base_weight_EH, self.base_bias_E

    def parameters(self) -> list[torch.Tensor]:
        """The router's own parameters: its weight and, with ``add_bias_linear``, its gating bias."""
        return list(self.module.parameters(recurse=False))


@dataclass
class MegatronAnchorHandle(RoutingFigures):
    config: AnchorConfig
    method: Method
    routers: list[MegatronRouter]
    prior: PriorRouting | None
    tp_rank: int = 0
    tp_size: int = 1
    sequence_parallel: bool = False
    notes: list[str] = field(default_factory=list)
    #: stand-in for the TP all-gather of router rows (forward all-gather, backward reduce-scatter);
    #: None: Megatron's ``gather_from_sequence_parallel_region`` on the routers' TP group
    gather_rows: Callable[[torch.Tensor], torch.Tensor] | None = None
    _context: TokenContext | None = None
    _restore: list = field(default_factory=list)
    #: the input each router's ``gating`` received, picked up by the ``routing`` call that follows
    _inputs: dict = field(default_factory=dict)

    # ---- per-micro-batch context -----------------------------------------------------
    def set_micro_batch(
        self,
        sample_BS: torch.Tensor,
        span_BS: torch.Tensor,
        base_ids_BSLK: torch.Tensor | None = None,
        base_probs_BSLK: torch.Tensor | None = None,
        base_extra_BSLJ: tuple[torch.Tensor, torch.Tensor] | None = None,
    ) -> TokenContext:
        """Set the (sample, span) of every token of the micro-batch about to run forward.

        ``sample_BS`` / ``span_BS`` are the full micro-batch as the data loader yields it
        (``[micro_batch, seq_len]``; a packed THD micro-batch is ``[1, total_len]``, see
        ``layout.pack_thd``); padding has sample -1. The handle lays them out as this TP rank's
        routers see their rows. The context stays set -- through backward and any
        recomputation -- until the next call or ``clear()``; the anchor's loss terms of the
        micro-batch live in it. ``routing-kd`` also takes the base's stored routes of these tokens
        (``base_ids_BSLK``, and ``base_probs_BSLK`` where the route file holds probabilities; with a ``--top-m``
        file, ``base_extra_BSLJ``, the extra experts' ids and probabilities: ``StoredRoutes.extra_BSLJ``).
        """
        if sample_BS.shape != span_BS.shape:
            raise ValueError(f"sample index {tuple(sample_BS.shape)} and span {tuple(span_BS.shape)} differ in shape")
        sample_T = router_rows(sample_BS, self.tp_rank, self.tp_size, self.sequence_parallel)
        span_T = router_rows(span_BS, self.tp_rank, self.tp_size, self.sequence_parallel)
        valid_T = sample_T >= 0
        span_T = torch.where(valid_T, span_T, torch.full_like(span_T, STRUCTURAL))
        self._context = TokenContext(sample_T, span_T, valid_T)
        if self.method.teacher == "routing":
            self._context.base = self._base_rows(sample_BS, base_ids_BSLK, base_probs_BSLK, base_extra_BSLJ)
        return self._context

    def _base_rows(self, sample_BS, ids_BSLK, probs_BSLK, extra_BSLJ=None) -> BaseRouting:
        """The base's stored routes laid out as the routers' rows (the whole micro-batch's under sequence
        parallelism, where the term reads the gathered rows)."""
        if ids_BSLK is None:
            raise RuntimeError(
                f"{self.method.name}: the micro-batch has no base routes; pass base_ids_BSLK (and base_probs_BSLK) "
                "to set_micro_batch, read from the route file (rpb.teacher.StoredRoutes.routes_BSLK)"
            )
        B, S, L, _ = ids_BSLK.shape
        if tuple(sample_BS.shape) != (B, S) or len(self.routers) != L:
            raise RuntimeError(
                f"{self.method.name}: base routes of shape {tuple(ids_BSLK.shape)} for a micro-batch "
                f"{tuple(sample_BS.shape)} of {len(self.routers)} routers"
            )
        tp_rank, tp_size = (0, 1) if self._split else (self.tp_rank, self.tp_size)
        return stored_rows(ids_BSLK, probs_BSLK, extra_BSLJ, tp_rank, tp_size)

    def clear(self) -> None:
        self._context = None
        self._inputs = {}

    @contextlib.contextmanager
    def step(
        self,
        sample_BS: torch.Tensor,
        span_BS: torch.Tensor,
        base_ids_BSLK=None,
        base_probs_BSLK=None,
        base_extra_BSLJ=None,
    ):
        """``set_micro_batch`` for a block that holds forward *and* backward; clears on exit."""
        ctx = self.set_micro_batch(sample_BS, span_BS, base_ids_BSLK, base_probs_BSLK, base_extra_BSLJ)
        try:
            yield ctx
        finally:
            self.clear()

    # ---- the loss term -----------------------------------------------------------------
    @property
    def loss_shares(self) -> int:
        """How many TP ranks each return a share of the term: ``tp_size`` under sequence parallelism, else 1."""
        return self.tp_size if self._split else 1

    def loss(self) -> torch.Tensor:
        """This rank's share of the anchor's loss term for the current micro-batch (coefficient applied; 0 for none).

        ``coef * mean over routers`` of the per-router terms recorded by the micro-batch's
        forward in train mode, as ``AnchorHandle.loss()``. Call it after the forward and before
        the context moves on (Megatron calls the loss function right after the forward step).
        Under sequence parallelism it is ``1 / tp`` of the whole term (see the module doc);
        ``loss() * loss_shares`` is the whole value, for logging.
        """
        ctx, anchor = self._context, self.method.loss
        if anchor is None or ctx is None:
            return torch.zeros((), device=self.routers[0].module.weight.device)
        # a term of the weights alone is computed now: Megatron's reentrant recomputation runs the
        # forward without grad, so a term built there could not train them
        terms = [
            ctx.cache[("term", r.pos)] if anchor.from_forward else self._share(anchor.term(self._state(r)))
            for r in self.routers
            if ("recorded", r.pos) in ctx.cache
        ]
        if not terms:
            return torch.zeros((), device=self.routers[0].module.weight.device)
        term = self.config.coefficient() * torch.stack(terms).mean()
        trainable = any(p.requires_grad for r in self.routers for p in r.parameters())
        if torch.is_grad_enabled() and trainable and not term.requires_grad:
            raise RuntimeError(
                f"{self.method.name}: the routers ran without gradients in this micro-batch, so the anchor's loss "
                "term cannot train them; Megatron's reentrant recomputation (recompute_granularity=full, or "
                "'moe' in recompute_modules) runs the first forward without grad: recompute other modules"
            )
        return term

    def _state(self, r: MegatronRouter) -> RouterState:
        """Router ``r`` as a loss term sees it; the weight pairs only where the term reads them."""
        transform = self.config.router_transform or family_transform(r.module.score_function)
        state = RouterState(r.module.score_function, r.module.topk, transform)
        if "weights" in self.method.loss.reads:
            w = r.module.weight
            base_weight_EH, base_bias_E = r.base_on(w.device)
            state.weights = (
                ((w, base_weight_EH),) if base_bias_E is None else ((w, base_weight_EH), (r.module.bias, base_bias_E))
            )
        return state

    def _share(self, term: torch.Tensor) -> torch.Tensor:
        """This rank's share of a term every TP rank computes whole: under sequence parallelism
        Megatron sums the router's gradients over the TP group, so each rank contributes 1 / tp."""
        return term / self.tp_size if self._split else term

    @property
    def _split(self) -> bool:
        return self.sequence_parallel and self.tp_size > 1

    def _gather(self, x_TC: torch.Tensor) -> torch.Tensor:
        """This rank's rows -> the micro-batch's rows (rank order is position order, see ``layout``)."""
        if self.gather_rows is not None:
            return self.gather_rows(x_TC)
        group = self.routers[0].module.tp_group
        if group.size() != self.tp_size:
            raise RuntimeError(
                f"the routers' TP group has {group.size()} rank(s) but the handle lays out tp_size={self.tp_size}; "
                "the loss terms under sequence parallelism need the real group (or a gather_rows stand-in)"
            )
        from megatron.core.tensor_parallel.mappings import gather_from_sequence_parallel_region

        return gather_from_sequence_parallel_region(x_TC, tensor_parallel_output_grad=True, group=group)

    def _record_loss(self, r: MegatronRouter, logits, hidden, padding_mask, ctx: TokenContext) -> None:
        """Record router ``r``'s term for this micro-batch (the first call's; a recomputed forward adds nothing)."""
        anchor = self.method.loss
        logits_TE = logits.reshape(-1, logits.shape[-1])
        self._check_rows(r, logits_TE.shape[0], ctx)
        first_call = ("recorded", r.pos) not in ctx.cache
        ctx.cache[("recorded", r.pos)] = True
        if not anchor.from_forward:
            return  # computed from the weights in loss()
        valid_T = ctx.valid_T.to(logits_TE.device)
        if padding_mask is not None:
            valid_T = valid_T & ~padding_mask.reshape(-1).to(valid_T.device).bool()
        parts = [logits_TE.float()]
        if "base_logits" in anchor.reads:
            if hidden is None:
                raise RuntimeError(
                    f"router {r.name}: routing() ran without a gating() call before it, so {self.method.name} has no "
                    "router input to compute the base logits from; run the router's forward"
                )
            base_weight_EH, base_bias_E = r.base_on(logits_TE.device)
            # as the HF path: float32, and the input keeps its graph (the base logits depend on it too)
            hidden_TH = hidden.reshape(-1, hidden.shape[-1]).float()
            parts.append(nn.functional.linear(hidden_TH, base_weight_EH, base_bias_E))
        if self._split:
            # the whole micro-batch's rows on every rank: one gather, the mask riding along as a column
            rows_TC = self._gather(torch.cat([*parts, valid_T[:, None].float()], dim=-1))
            E = logits_TE.shape[-1]
            parts = [rows_TC[:, i * E : (i + 1) * E] for i in range(len(parts))]
            valid_T = rows_TC[:, -1] > 0.5
        state = self._state(r)
        state.logits_TE, state.valid_T = parts[0], valid_T
        state.base_logits_TE = parts[1] if len(parts) > 1 else None
        if "base_routing" in anchor.reads:
            take_stored(state, ctx.base, r.pos, logits_TE.device, self.config.routes_loss)
            if routes_loss_form(self.config.routes_loss, ctx.base.probs_LTK is not None) == "hinge":
                state.spec, state.expert_bias_E = selection_spec(r.module, r.name), r.module.expert_bias
        # every rank computed the whole term; each contributes 1 / tp (module doc)
        term = self._share(anchor.term(state))
        # computed on every call, so a recomputed forward saves exactly what the first one did
        # (non-reentrant checkpointing checks that); only the first call's term is kept
        if first_call:
            ctx.cache[("term", r.pos)] = term
            if state.active_T is not None:  # the ids-alone hinge: where it is active, of the rows it counts
                active = [float(state.active_T.sum()), float((state.valid_T > 0).sum())]
                ctx.cache[("hinge", r.pos)] = torch.tensor(active, dtype=torch.float64)

    def _check_rows(self, r: MegatronRouter, num_rows: int, ctx: TokenContext) -> None:
        if num_rows != ctx.num_tokens:
            raise RuntimeError(
                f"router {r.name} saw {num_rows} tokens but the micro-batch context lays out "
                f"{ctx.num_tokens} (tp_rank={self.tp_rank}, tp_size={self.tp_size}, "
                f"sequence_parallel={self.sequence_parallel}); pass the micro-batch's own sample and span tensors"
            )

    # ---- the replacement routing (and gating, which only hands routing its input) ----------
    def _gating(self, r: MegatronRouter, original):
        def gating(input, *args, **kwargs):
            # the input as the router linear sees it (after input jitter), for the base logits
            self._inputs[r.pos] = input
            return original(input, *args, **kwargs)

        return gating

    def _routing(self, r: MegatronRouter, original):
        def routing(logits, *args, **kwargs):
            ctx = self._context
            hidden = self._inputs.pop(r.pos, None)
            if ctx is None or not r.module.training:
                return original(logits, *args, **kwargs)
            padding_mask = kwargs.get("padding_mask", args[0] if args else None)
            if self.method.loss is not None:
                self._record_loss(r, logits, hidden, padding_mask, ctx)
            if self.prior is None:
                self._record_counts(r, logits, hidden, padding_mask, ctx, None, None)
                return original(logits, *args, **kwargs)
            ids_TK = self._selection(r, logits, padding_mask, ctx, hidden)
            with forced_topk(r.module, ids_TK, f"router {r.name} ({self.method.name})"):
                return original(logits, *args, **kwargs)

        return routing

    def _selection(self, r: MegatronRouter, logits, padding_mask, ctx: TokenContext, hidden=None) -> torch.Tensor:
        logits_TE = logits.detach().reshape(-1, logits.shape[-1])
        self._check_rows(r, logits_TE.shape[0], ctx)
        tables = self.prior.tables(ctx, logits_TE.device)
        content_T = tables.content_T
        if padding_mask is not None:
            # megatron-core treats True as padding (routing_map & ~padding_mask), whatever some docstrings say
            content_T = content_T & ~padding_mask.reshape(-1).to(content_T.device).bool()
        native_TK = megatron_select(r.module, logits_TE)
        if tables.bias_PLE is not None:
            bias_TE = tables.bias_PLE[tables.pair_T, r.pos] * content_T[:, None]
            # float32: a bf16 sum would round b before it chooses (spacing ~0.03 near 4)
            chosen_TK = megatron_select(r.module, logits_TE.float() + bias_TE)
        else:
            chosen_TK = tables.topk_PLK[tables.pair_T, r.pos]
        # structural and padding tokens keep exactly the native choice (and so the native weights)
        chosen_TK = torch.where(content_T[:, None], chosen_TK, native_TK)
        self._record_counts(r, logits, hidden, padding_mask, ctx, chosen_TK, native_TK)
        return chosen_TK

    def _native_topk(self, router: nn.Module, logits_TE: torch.Tensor) -> torch.Tensor:
        return megatron_select(router, logits_TE)

    # ---- removal ------------------------------------------------------------------
    def remove(self) -> None:
        self.clear()
        for restore in reversed(self._restore):
            restore()
        self._restore = []
        for r in self.routers:
            r.base_weight_EH = r.base_bias_E = None
