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
"""

from __future__ import annotations

import contextlib
import inspect
import logging
from dataclasses import dataclass, field

import torch
from torch import nn

from rpb.anchors.context import TokenContext
from rpb.anchors.handle import AnchorConfig
from rpb.anchors.methods import Method, get_method
from rpb.anchors.prior_routing import PriorRouting
from rpb.integrations.megatron.layout import router_rows
from rpb.prior import STRUCTURAL

logger = logging.getLogger(__name__)

#: anchors whose whole effect is the routing choice (plus sft, which installs nothing)
SUPPORTED_METHODS = ("sft", "rpb", "rpb-hard", "within-soft", "within-hard", "global-hard")
_TOPK_ROUTING_TYPES = ("aux_loss", "seq_aux_loss", "global_aux_loss", "none")


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
    """One installed router: its position in the prior's layer axis and its global layer number."""

    pos: int
    name: str
    module: nn.Module
    layer_number: int

    @property
    def hf_layer_index(self) -> int:
        """The 0-based decoder-layer index (Megatron numbers layers from 1)."""
        return self.layer_number - 1


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
    _context: TokenContext | None = None
    _restore: list = field(default_factory=list)

    # ---- per-micro-batch context -----------------------------------------------------
    def set_micro_batch(self, sample_BS: torch.Tensor, span_BS: torch.Tensor) -> TokenContext:
        """Set the (sample, span) of every token of the micro-batch about to run forward.

        ``sample_BS`` / ``span_BS`` are the full micro-batch as the data loader yields it
        (``[micro_batch, seq_len]``; a packed THD micro-batch is ``[1, total_len]``, see
        ``layout.pack_thd``); padding has sample -1. The handle lays them out as this TP rank's
        routers see their rows. The context stays set -- through backward and any
        recomputation -- until the next call or ``clear()``.
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

    @contextlib.contextmanager
    def step(self, sample_BS: torch.Tensor, span_BS: torch.Tensor):
        """``set_micro_batch`` for a block that holds forward *and* backward; clears on exit."""
        ctx = self.set_micro_batch(sample_BS, span_BS)
        try:
            yield ctx
        finally:
            self.clear()

    # ---- the replacement routing ------------------------------------------------------------
    def _routing(self, r: MegatronRouter, original):
        def routing(logits, *args, **kwargs):
            ctx = self._context
            if self.prior is None or ctx is None or not r.module.training:
                return original(logits, *args, **kwargs)
            padding_mask = kwargs.get("padding_mask", args[0] if args else None)
            ids_TK = self._selection(r, logits, padding_mask, ctx)
            r.module.router_replay = _ForcedTopK(ids_TK)
            try:
                return original(logits, *args, **kwargs)
            finally:
                r.module.router_replay = None

        return routing

    def _selection(self, r: MegatronRouter, logits, padding_mask, ctx: TokenContext) -> torch.Tensor:
        logits_TE = logits.detach().reshape(-1, logits.shape[-1])
        if logits_TE.shape[0] != ctx.num_tokens:
            raise RuntimeError(
                f"router {r.name} saw {logits_TE.shape[0]} tokens but the micro-batch context lays out "
                f"{ctx.num_tokens} (tp_rank={self.tp_rank}, tp_size={self.tp_size}, "
                f"sequence_parallel={self.sequence_parallel}); pass the micro-batch's own sample and span tensors"
            )
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
        self._context = None
        for restore in reversed(self._restore):
            restore()
        self._restore = []


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
        hint = {
            "lbl": "use Megatron's own moe_router_load_balancing_type=aux_loss with moe_aux_loss_coeff",
            "router-freeze": "freeze the router weights before the optimizer is built",
        }.get(method.name, "its loss term has no Megatron implementation here")
        out.append(
            f"anchor.method {method.name!r} is not supported on Megatron-Core ({hint}); supported: "
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
    if any("routing" in vars(r.module) for r in routers):
        out.append("an anchor is already installed on these routers; remove() it first")
    if any(r.module.router_replay is not None for r in routers):
        out.append("moe_enable_routing_replay=True: a routing replay and the anchor would both force the top-k")
    if any(getattr(r.module, "is_mtp_layer", False) for r in routers):
        out.append("the model has multi-token-prediction routers, which the prior does not cover")
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
    by ``remove()``. Raises ``MegatronAnchorError`` listing every problem.
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
    for r in routers:
        module = r.module
        module.routing = handle._routing(r, module.routing)
        # deleting the instance attribute uncovers the class's own routing again
        handle._restore.append(lambda module=module: module.__dict__.pop("routing", None))
    return handle


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
