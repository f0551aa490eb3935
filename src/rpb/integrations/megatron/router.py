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
``precomputed_indices``, which this integration does not need). Installing refuses any router
whose routing would bypass it: the fused router (``moe_router_fusion``), sinkhorn or quantile
balancing, an active routing replay.

In eval mode, or with no micro-batch context set, the original ``routing`` runs untouched.
The context stays set until the next micro-batch or ``clear()``, so activation recomputation
during backward routes alike. Pipeline parallelism (micro-batches interleave their forward
and backward passes) and context parallelism are refused; the paper used neither.

The loss-based anchors (``lbl``, ``router-l2``, ``kl-to-base``, ``logit-l2``) and
``router-freeze`` keep Megatron's own selection and follow the HF path (``rpb.anchors.handle``)
term for term, with the math of ``rpb.losses``:

* ``router-freeze``: every router parameter (the weight, and the gating bias a router built with
  ``add_bias_linear`` has) gets ``requires_grad=False`` until ``remove()``. Megatron's DDP and
  optimizer take the trainable parameters when they wrap the model, so freeze before that
  (``freeze_router_parameters`` as a Bridge pre-wrap hook); a router parameter that already has
  Megatron's ``main_grad`` buffer is refused.
* ``router-l2``: ``lambda * mean over routers of ||W - W_base||^2`` (plus the same term for a
  gating bias), ``W_base`` a float32 copy taken at install on the router's device. Megatron's
  router weight is a full ``[E, H]`` parameter on every TP rank (replicated, never sharded), so
  the copy is the whole matrix. The term is computed from the weights in ``loss()``, so it
  reaches them under any activation recomputation.
* ``kl-to-base`` / ``logit-l2``: the base logits of the same tokens, ``linear(x, W_base)`` in
  float32 on the router input ``x`` that ``gating`` receives (after any input jitter); the
  router's ``gating`` is wrapped on the instance only to hand that input to ``routing``.
* ``lbl``: ``rpb.losses.load_balancing_sigmoid`` (sigmoid routers; Megatron's ``aux_loss`` form)
  or ``load_balancing_softmax`` (transformers' form, ``k`` times Megatron's) on the unbiased
  logits, exactly the HF path's term, not Megatron's native auxiliary loss (which must be off:
  ``moe_aux_loss_coeff=0``, else it would count twice).

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

The terms built from the forward (``lbl``, ``kl-to-base``, ``logit-l2``) need the router's
forward to run with gradients: Megatron's reentrant recomputation of whole layers
(``recompute_granularity="full"``) or of the MoE layer (``recompute_modules`` with ``"moe"``)
runs the first forward without them, so those settings are refused for these methods.
"""

from __future__ import annotations

import contextlib
import inspect
import logging
from collections.abc import Callable
from dataclasses import dataclass, field

import torch
from torch import nn

from rpb import losses
from rpb.anchors.context import TokenContext
from rpb.anchors.handle import AnchorConfig
from rpb.anchors.methods import Method, get_method
from rpb.anchors.prior_routing import PriorRouting
from rpb.integrations.megatron.layout import router_rows
from rpb.prior import STRUCTURAL

logger = logging.getLogger(__name__)

#: every method of the HF path (``rpb.anchors.methods``); a method added there is refused here until implemented
SUPPORTED_METHODS = (
    "sft",
    "lbl",
    "rpb",
    "router-l2",
    "kl-to-base",
    "logit-l2",
    "rpb-hard",
    "within-soft",
    "within-hard",
    "global-hard",
    "router-freeze",
)
_TOPK_ROUTING_TYPES = ("aux_loss", "seq_aux_loss", "global_aux_loss", "none")
#: loss terms computed from the router's forward (router-l2 is computed from the weights alone)
_FORWARD_LOSSES = ("lbl", "kl-to-base", "logit-l2")
#: loss terms that compare with the base router's logits
_BASE_LOGIT_LOSSES = ("kl-to-base", "logit-l2")


class MegatronAnchorError(ValueError):
    def __init__(self, problems: list[str]):
        self.problems = problems
        super().__init__(
            f"cannot install the anchor into this Megatron-Core model ({len(problems)} problem(s)):\n"
            + "\n".join(f"  - {p}" for p in problems)
        )


# ---- the two replay objects (duck-typed ``RouterReplay.get_replay_topk``) -------------------
class _CaptureTopK:
    """Runs Megatron's own top-k and keeps the indices it chose."""

    def __init__(self):
        self.indices = None

    def get_replay_topk(self, scores, topk, num_groups=None, group_topk=None, default_compute_topk=None):
        values, indices = default_compute_topk(scores, topk, num_groups=num_groups, group_topk=group_topk)
        self.indices = indices
        return values, indices


class _ForcedTopK:
    """Hands Megatron indices chosen elsewhere; Megatron gathers its unbiased scores at them."""

    def __init__(self, ids_TK: torch.Tensor):
        self.ids_TK = ids_TK

    def get_replay_topk(self, scores, topk, num_groups=None, group_topk=None, default_compute_topk=None):
        ids_TK = self.ids_TK.to(scores.device)
        return scores.gather(1, ids_TK), ids_TK


def _topk_function():
    """``topk_routing_with_score_function`` as ``router.py`` calls it (looked up by name, at call time)."""
    from megatron.core.transformer.moe import router as router_module

    return router_module.topk_routing_with_score_function


def megatron_select(router: nn.Module, logits_TE: torch.Tensor) -> torch.Tensor:
    """``topk_ids_TK``: the experts Megatron's own selection pipeline picks for ``logits_TE``.

    The router's score function, pre-softmax flag, expert bias and group-limited top-k, exactly
    as ``TopKRouter.routing`` passes them (never the fused kernel, which install refuses). The
    logits are detached, so no graph is built; grad mode is left as the caller has it, because
    newer megatron-core sorts its top-k only when grad is enabled, and the indices should come
    in the order the native routing would produce.
    """
    c = router.config
    capture = _CaptureTopK()
    _topk_function()(
        logits_TE.detach(),
        router.topk,
        use_pre_softmax=c.moe_router_pre_softmax,
        num_groups=c.moe_router_num_groups,
        group_topk=c.moe_router_group_topk,
        scaling_factor=c.moe_router_topk_scaling_factor,
        score_function=router.score_function,
        expert_bias=router.expert_bias,
        fused=False,
        router_replay=capture,
    )
    return capture.indices


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
class MegatronAnchorHandle:
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
    def set_micro_batch(self, sample_BS: torch.Tensor, span_BS: torch.Tensor) -> TokenContext:
        """Set the (sample, span) of every token of the micro-batch about to run forward.

        ``sample_BS`` / ``span_BS`` are the full micro-batch as the data loader yields it
        (``[micro_batch, seq_len]``; a packed THD micro-batch is ``[1, total_len]``, see
        ``layout.pack_thd``); padding has sample -1. The handle lays them out as this TP rank's
        routers see their rows. The context stays set -- through backward and any
        recomputation -- until the next call or ``clear()``; the anchor's loss terms of the
        micro-batch live in it.
        """
        if sample_BS.shape != span_BS.shape:
            raise ValueError(f"sample index {tuple(sample_BS.shape)} and span {tuple(span_BS.shape)} differ in shape")
        sample_T = router_rows(sample_BS, self.tp_rank, self.tp_size, self.sequence_parallel)
        span_T = router_rows(span_BS, self.tp_rank, self.tp_size, self.sequence_parallel)
        valid_T = sample_T >= 0
        span_T = torch.where(valid_T, span_T, torch.full_like(span_T, STRUCTURAL))
        self._context = TokenContext(sample_T, span_T, valid_T)
        return self._context

    def clear(self) -> None:
        self._context = None
        self._inputs = {}

    @contextlib.contextmanager
    def step(self, sample_BS: torch.Tensor, span_BS: torch.Tensor):
        """``set_micro_batch`` for a block that holds forward *and* backward; clears on exit."""
        ctx = self.set_micro_batch(sample_BS, span_BS)
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
        ctx, kind = self._context, self.method.loss
        if kind is None or ctx is None:
            return torch.zeros((), device=self.routers[0].module.weight.device)
        # router-l2 from the weights, now: Megatron's reentrant recomputation runs the forward
        # without grad, so a term built there could not train them
        terms = [
            self._router_l2(r) if kind == "router-l2" else ctx.cache[("term", r.pos)]
            for r in self.routers
            if ("recorded", r.pos) in ctx.cache
        ]
        if not terms:
            return torch.zeros((), device=self.routers[0].module.weight.device)
        coef = self.config.lambda_ if self.method.coefficient == "lambda" else self.config.lbl_coef
        term = coef * torch.stack(terms).mean()
        trainable = any(p.requires_grad for r in self.routers for p in r.parameters())
        if torch.is_grad_enabled() and trainable and not term.requires_grad:
            raise RuntimeError(
                f"{self.method.name}: the routers ran without gradients in this micro-batch, so the anchor's loss "
                "term cannot train them; Megatron's reentrant recomputation (recompute_granularity=full, or "
                "'moe' in recompute_modules) runs the first forward without grad: recompute other modules"
            )
        return term

    def _router_l2(self, r: MegatronRouter) -> torch.Tensor:
        w = r.module.weight
        base_weight_EH, base_bias_E = r.base_on(w.device)
        term = losses.router_l2(w, base_weight_EH)
        if base_bias_E is not None:
            # the gating bias is part of the router, anchored like its weight (HF routers have none)
            term = term + losses.router_l2(r.module.bias, base_bias_E)
        # every TP rank holds the whole weight; under sequence parallelism Megatron sums its
        # gradient over the TP group, so each rank contributes 1 / tp
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
        kind = self.method.loss
        logits_TE = logits.reshape(-1, logits.shape[-1])
        self._check_rows(r, logits_TE.shape[0], ctx)
        first_call = ("recorded", r.pos) not in ctx.cache
        ctx.cache[("recorded", r.pos)] = True
        if kind == "router-l2":
            return  # computed from the weights in loss()
        valid_T = ctx.valid_T.to(logits_TE.device)
        if padding_mask is not None:
            valid_T = valid_T & ~padding_mask.reshape(-1).to(valid_T.device).bool()
        parts = [logits_TE.float()]
        if kind in _BASE_LOGIT_LOSSES:
            if hidden is None:
                raise RuntimeError(
                    f"router {r.name}: routing() ran without a gating() call before it, so {kind} has no router "
                    "input to compute the base logits from; run the router's forward"
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
        term = self._term(r, parts, valid_T)
        # every rank computed the whole term; each contributes 1 / tp (module doc)
        term = term / self.tp_size if self._split else term
        # computed on every call, so a recomputed forward saves exactly what the first one did
        # (non-reentrant checkpointing checks that); only the first call's term is kept
        if first_call:
            ctx.cache[("term", r.pos)] = term

    def _term(self, r: MegatronRouter, parts: list[torch.Tensor], valid_T: torch.Tensor) -> torch.Tensor:
        kind, logits_TE = self.method.loss, parts[0]
        if kind == "lbl":
            sigmoid = r.module.score_function == "sigmoid"
            fn = losses.load_balancing_sigmoid if sigmoid else losses.load_balancing_softmax
            return fn(logits_TE, r.module.topk, valid_T)
        if kind == "kl-to-base":
            return losses.kl_to_base(logits_TE, parts[1], valid_T, self.config.router_transform or "softmax")
        return losses.logit_l2(logits_TE, parts[1], valid_T)

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
                return original(logits, *args, **kwargs)
            ids_TK = self._selection(r, logits, padding_mask, ctx)
            r.module.router_replay = _ForcedTopK(ids_TK)
            try:
                return original(logits, *args, **kwargs)
            finally:
                r.module.router_replay = None

        return routing

    def _selection(self, r: MegatronRouter, logits, padding_mask, ctx: TokenContext) -> torch.Tensor:
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
        return torch.where(content_T[:, None], chosen_TK, native_TK)

    # ---- removal ------------------------------------------------------------------
    def remove(self) -> None:
        self.clear()
        for restore in reversed(self._restore):
            restore()
        self._restore = []
        for r in self.routers:
            r.base_weight_EH = r.base_bias_E = None


def find_topk_routers(model) -> list[MegatronRouter]:
    """Every ``TopKRouter`` of ``model`` (a module or a list of model chunks), in layer order."""
    from megatron.core.transformer.moe.router import TopKRouter

    chunks = model if isinstance(model, (list, tuple)) else [model]
    found = []
    for c, chunk in enumerate(chunks):
        for name, module in chunk.named_modules():
            if isinstance(module, TopKRouter):
                prefix = f"chunk{c}." if len(chunks) > 1 else ""
                found.append((int(module.layer_number or 0), prefix + name, module))
    found.sort(key=lambda x: x[0])
    return [MegatronRouter(pos, name, module, number) for pos, (number, name, module) in enumerate(found)]


def _install_problems(routers: list[MegatronRouter], method: Method) -> list[str]:
    out = []
    if method.name not in SUPPORTED_METHODS:
        out.append(
            f"anchor.method {method.name!r} has no Megatron-Core implementation; supported: "
            f"{', '.join(SUPPORTED_METHODS)}"
        )
    if not routers:
        return [*out, "no megatron.core.transformer.moe.router.TopKRouter in the model"]
    params = inspect.signature(_topk_function()).parameters
    if "router_replay" not in params:
        out.append(
            "this megatron-core's topk_routing_with_score_function has no router_replay argument; "
            "megatron-core >= 0.16 is needed"
        )
    numbers = [r.layer_number for r in routers]
    if len(set(numbers)) != len(numbers):
        out.append(f"routers share layer numbers {numbers}; cannot map them onto the prior's layers")
    configs = {id(r.module.config): r.module.config for r in routers}.values()
    for c in configs:
        if c.moe_router_fusion:
            out.append(
                "moe_router_fusion=True: the fused router kernel bypasses Python routing, so no bias "
                "could reach the selection; set moe_router_fusion=False"
            )
        if (c.context_parallel_size or 1) > 1:
            out.append(
                f"context_parallel_size={c.context_parallel_size}: each sequence is cut into "
                "2 * cp chunks, whose per-token layout is not supported; use cp=1 (as the paper)"
            )
        if (c.pipeline_model_parallel_size or 1) > 1:
            out.append(
                f"pipeline_model_parallel_size={c.pipeline_model_parallel_size}: pipeline schedules "
                "interleave micro-batches, so one micro-batch context cannot serve activation "
                "recomputation; use pp=1 (as the paper)"
            )
        if getattr(c, "mtp_num_layers", None):
            out.append(
                f"mtp_num_layers={c.mtp_num_layers}: the prior has no rows for multi-token-prediction "
                "routers; disable MTP"
            )
        if getattr(c, "moe_router_force_load_balancing", False):
            out.append("moe_router_force_load_balancing=True replaces the logits with random ones")
        if getattr(c, "moe_router_force_biased", None) is not None:
            out.append("moe_router_force_biased adds a random bias to the logits; unset it")
        if c.moe_router_score_function not in ("softmax", "sigmoid"):
            out.append(f"moe_router_score_function={c.moe_router_score_function!r}: only softmax and sigmoid")
        types = c.moe_router_load_balancing_type
        for t in types if isinstance(types, list) else [types]:
            if t not in _TOPK_ROUTING_TYPES:
                out.append(
                    f"moe_router_load_balancing_type={t!r} does not route through "
                    "topk_routing_with_score_function; use aux_loss, seq_aux_loss, global_aux_loss or none"
                )
        if method.loss in _FORWARD_LOSSES:
            recompute = getattr(c, "recompute_granularity", None)
            modules = getattr(c, "recompute_modules", None) or []
            if recompute == "full" or (recompute == "selective" and "moe" in modules):
                out.append(
                    f"recompute_granularity={recompute!r}, recompute_modules={modules}: Megatron's reentrant "
                    f"recomputation runs the routers' first forward without grad, so {method.name}'s loss term "
                    "could not train them; use selective recomputation without 'moe'"
                )
    if any("routing" in vars(r.module) for r in routers):
        out.append("an anchor is already installed on these routers; remove() it first")
    if any(r.module.router_replay is not None for r in routers):
        out.append("moe_enable_routing_replay=True: a routing replay and the anchor would both force the top-k")
    if any(getattr(r.module, "is_mtp_layer", False) for r in routers):
        out.append("the model has multi-token-prediction routers, which the prior does not cover")
    if method.loss == "lbl":
        native = [r.name for r in routers if r.module.is_aux_loss_enabled()]
        if native:
            out.append(
                f"lbl computes the HF path's load-balancing loss itself, and {len(native)} router(s) also add "
                "Megatron's native auxiliary loss; set moe_aux_loss_coeff=0 (or moe_router_load_balancing_type=none)"
            )
    if method.freeze_router:
        # Megatron's DDP gives each trainable parameter a main_grad buffer and the optimizer a
        # copy: freezing after that leaves the optimizer (its weight decay) moving the router
        wrapped = [r.name for r in routers if any(p.requires_grad and hasattr(p, "main_grad") for p in r.parameters())]
        if wrapped:
            out.append(
                f"router-freeze: {len(wrapped)} router(s) are already trainable in Megatron's DDP and optimizer; "
                "freeze them before the model is wrapped (freeze_router_parameters as a pre-wrap hook)"
            )
    return out


def install_megatron_anchor(
    model,
    config: AnchorConfig,
    prior: torch.Tensor | None = None,
    sigma_LE: torch.Tensor | None = None,
    *,
    tp_rank: int | None = None,
    tp_size: int | None = None,
    sequence_parallel: bool | None = None,
) -> MegatronAnchorHandle:
    """Install ``config.method`` into every ``TopKRouter`` of a built Megatron-Core model.

    ``prior`` is ``pi [samples, 2, MoE layers, experts]``; its layer axis follows the routers'
    layer numbers. ``tp_rank`` / ``tp_size`` / ``sequence_parallel`` default to the routers' TP
    group and config (override them to lay out another rank's rows, as the tests do on one
    process). Expert biases stay as
    loaded and are frozen: ``moe_router_bias_update_rate`` is forced to 0 (logged), restored
    by ``remove()``. The methods that compare with the base router copy every router's weight
    (and gating bias) here, so install on the loaded base weights, before the first optimizer
    step. Raises ``MegatronAnchorError`` listing every problem.
    """
    problems = config.problems()
    method = get_method(config.method) if not problems else None
    if method is None:
        raise MegatronAnchorError(problems)
    routers = find_topk_routers(model)
    problems += _install_problems(routers, method)
    num_experts = routers[0].module.config.num_moe_experts if routers else 0
    if method.needs_prior and not problems:
        if prior is None:
            problems.append(f"method {method.name!r} needs the prior (pi, [samples, 2, MoE layers, experts])")
        elif prior.dim() != 4 or tuple(prior.shape[1:]) != (2, len(routers), num_experts):
            problems.append(
                f"prior of shape {tuple(prior.shape)} does not fit the model's {len(routers)} "
                f"routers x {num_experts} experts"
            )
        if method.shuffle is not None and sigma_LE is None:
            problems.append(f"method {method.name!r} needs sigma_LE, the per-layer expert permutation")
    if problems:
        raise MegatronAnchorError(problems)

    first = routers[0].module
    routing = None
    if method.needs_prior:
        routing = PriorRouting(
            prior,
            method.selection,
            top_k=first.topk,
            beta=config.beta,
            eps=config.eps,
            clip=config.c,
            sigma_LE=sigma_LE if method.shuffle else None,
        )
    handle = MegatronAnchorHandle(
        config=config,
        method=method,
        routers=routers,
        prior=routing,
        tp_rank=first.tp_group.rank() if tp_rank is None else int(tp_rank),
        tp_size=first.tp_group.size() if tp_size is None else int(tp_size),
        sequence_parallel=bool(first.config.sequence_parallel if sequence_parallel is None else sequence_parallel),
    )
    _freeze_expert_bias(handle)
    if method.needs_base_router:
        for r in routers:
            r.base_weight_EH = r.module.weight.detach().float().clone()
            if r.module.bias is not None:
                r.base_bias_E = r.module.bias.detach().float().clone()
    if method.freeze_router:
        _freeze_routers(handle)
    for r in routers:
        module = r.module
        module.routing = handle._routing(r, module.routing)
        # deleting the instance attribute uncovers the class's own routing (and gating) again
        handle._restore.append(lambda module=module: module.__dict__.pop("routing", None))
        if method.loss in _BASE_LOGIT_LOSSES:
            module.gating = handle._gating(r, module.gating)
            handle._restore.append(lambda module=module: module.__dict__.pop("gating", None))
    return handle


def freeze_router_parameters(model):
    """``requires_grad=False`` on every ``TopKRouter`` parameter of ``model``; returns ``model``.

    Shaped as a Megatron-Bridge pre-wrap hook (``provider.register_pre_wrap_hook``): run on the
    model chunks before DDP and the optimizer take the trainable parameters, so the routers
    get no gradient buffer, no optimizer state and no weight decay.
    """
    for r in find_topk_routers(model):
        for p in r.parameters():
            p.requires_grad_(False)
    return model


def _freeze_routers(handle: MegatronAnchorHandle) -> None:
    """router-freeze: no router parameter trains while installed; ``remove()`` restores each flag."""
    params = [p for r in handle.routers for p in r.parameters()]
    already = sum(not p.requires_grad for p in params)
    for p in params:
        handle._restore.append(lambda p=p, flag=p.requires_grad: p.requires_grad_(flag))
        p.requires_grad_(False)
    note = (
        f"router-freeze: {len(params)} parameter(s) of {len(handle.routers)} router(s) frozen "
        f"(requires_grad=False; {already} already were)"
    )
    handle.notes.append(note)
    logger.warning("rpb: %s", note)


def _freeze_expert_bias(handle: MegatronAnchorHandle) -> None:
    """Keep every loaded expert bias fixed: it enters selection, but no step may update it."""
    biased = [r for r in handle.routers if r.module.expert_bias is not None]
    if not biased:
        return
    for c in {id(r.module.config): r.module.config for r in biased}.values():
        old = c.moe_router_bias_update_rate
        c.moe_router_bias_update_rate = 0.0
        handle._restore.append(lambda c=c, old=old: setattr(c, "moe_router_bias_update_rate", old))
        note = f"expert bias of {len(biased)} router(s) kept frozen: moe_router_bias_update_rate forced from {old} to 0"
        handle.notes.append(note)
        logger.warning("rpb: %s", note)
    for r in biased:
        # newer megatron-core skips routers flagged frozen_expert_bias in finalize_model_grads
        if hasattr(r.module, "frozen_expert_bias"):
            old_flag = r.module.frozen_expert_bias
            r.module.frozen_expert_bias = True
            handle._restore.append(lambda m=r.module, f=old_flag: setattr(m, "frozen_expert_bias", f))
