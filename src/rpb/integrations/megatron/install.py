"""Installing an anchor into every Megatron-Core ``TopKRouter`` of a built model, and what is refused.

``install_megatron_anchor`` finds the routers, checks everything that would keep the anchor from
reaching them (listing every problem at once), freezes the expert bias, copies the base router
for the methods that compare with it, and replaces each router's ``routing`` (and, for the
base-logit terms, ``gating``) on the instance; ``MegatronAnchorHandle.remove()`` undoes it all.
Every method of the methods table runs here: what a method needs is read off its entry.
"""

from __future__ import annotations

import inspect
import logging

import torch

from rpb.anchors.config import AnchorConfig
from rpb.anchors.methods import LBL, Method, get_method
from rpb.anchors.prior_routing import PriorRouting
from rpb.integrations.megatron.router import (
    MegatronAnchorError,
    MegatronAnchorHandle,
    MegatronRouter,
    topk_routing_function,
)

logger = logging.getLogger(__name__)

_TOPK_ROUTING_TYPES = ("aux_loss", "seq_aux_loss", "global_aux_loss", "none")


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


def _install_problems(routers: list[MegatronRouter], method: Method, config: AnchorConfig) -> list[str]:
    out = []
    if getattr(config, "target", None) is not None:
        out.append(
            "anchor.target on Megatron-Core: the routing overlap is measured and λ steered in the Hugging Face "
            "trainers only; give a fixed anchor.lambda"
        )
    if not routers:
        return [*out, "no megatron.core.transformer.moe.router.TopKRouter in the model"]
    params = inspect.signature(topk_routing_function()).parameters
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
        if method.loss is not None and method.loss.from_forward:
            recompute = getattr(c, "recompute_granularity", None)
            modules = getattr(c, "recompute_modules", None) or []
            if recompute == "full" or (recompute == "selective" and "moe" in modules):
                out.append(
                    f"recompute_granularity={recompute!r}, recompute_modules={modules}: Megatron's reentrant "
                    f"recomputation runs the routers' first forward without grad, so {method.name}'s loss term "
                    "could not train them; use selective recomputation without 'moe'"
                )
    if method.teacher == "output":
        out.append(
            f"{method.name} on Megatron-Core: the base's next-token distribution needs a second model's forward, "
            "which this integration does not run"
        )
    elif method.loss is not None and method.loss.reads & {"detached_logits", "hidden"}:
        out.append(
            f"{method.name} on Megatron-Core: a control of why routing-kd holds, built on the Hugging Face path only; "
            "use routing-kd"
        )
    elif method.teacher == "routing" and config.base != "routes":
        out.append(
            f"{method.name} with anchor.base={config.base} on Megatron-Core: the online base (a second model's "
            "forward) is not built here; use anchor.base=routes with the base's route file (rpb routes, or an engine's)"
        )
    if any("routing" in vars(r.module) for r in routers):
        out.append("an anchor is already installed on these routers; remove() it first")
    if method.selection is not None and any(r.module.router_replay is not None for r in routers):
        out.append(
            "moe_enable_routing_replay=True: Megatron's routing replay hands the router its recorded top-k through "
            f"the router_replay hook {method.name} chooses through, so the replayed routes would override the "
            "biased selection; turn it off, or use a loss anchor"
        )
    if any(getattr(r.module, "is_mtp_layer", False) for r in routers):
        out.append("the model has multi-token-prediction routers, which the prior does not cover")
    if method.loss is LBL:
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
    problems += _install_problems(routers, method, config)
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
        if method.needs_base_logits:
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
