"""What a Megatron-Bridge ``ConfigContainer`` may hold for the anchor to work, and what rpb sets itself.

Nothing here imports megatron: the container is read by attribute paths, so the same checks run
on every Bridge line (0.3.1 to 0.6.x) and on test doubles. A path that a line does not have (an
attribute missing there) is a feature that line lacks, and is skipped.

Two lists, both data:

* ``RUN_CONTRACT``: every routing-, schedule- and optimizer-relevant field ``build_container`` sets
  explicitly, to Bridge v0.3.1's Moonlight SFT values (the line the reference release ran), so that
  a recipe of the same name on a later line (0.6.x: EP overlap, delayed weight gradients, router
  fusion, the flex / HybridEP dispatcher, packing) runs the same run. Each change from the recipe's
  value is logged.
* ``ALLOWED``: the values the anchor supports for each anchor-relevant setting. ``container_problems``
  names every other value with the reason, before training; ``check_container`` raises them all.
  A rule marked ``selection_only`` binds only the methods that choose the top-k themselves
  (``Method.selection`` set: rpb, rpb-hard and the shuffled controls); told no method, every rule binds.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

import torch

from rpb.anchors.methods import get_method
from rpb.errors import ConfigError

logger = logging.getLogger(__name__)

_MISSING = object()

_OVERLAP = (
    "EP communication overlap runs the combined 1F1B schedule: micro-batch i+1's forward before micro-batch i's "
    "backward, so the anchor's per-micro-batch context would belong to the wrong micro-batch, and Bridge then asks "
    "the forward step for a schedule plan, in which the loss anchors' term and the routing figures are lost"
)
_DELAY = (
    "delayed weight-gradient computation (part of EP overlap) runs the experts' and routers' weight gradients after "
    "the next micro-batch's work, outside the micro-batch whose context the anchor set"
)

# megatron-core 0.16.1 moe_utils.py:699-707 and router_replay.py:146-159 (0.19.2: 825-833, 167-180)
_REPLAY = (
    "Megatron's routing replay hands its recorded top-k indices to the router through the same "
    "router_replay hook through which the anchor hands it the prior-biased selection: the replayed routes "
    "would override the biased choice, so the bias would have no effect on selection (the loss anchors, "
    "router-freeze and sft run with replay on: docs/megatron.md, Routing replay)"
)


@dataclass(frozen=True)
class Allowed:
    path: str
    values: tuple
    why: str
    #: binds only the methods that choose the top-k (``Method.selection`` set); the others take any value
    selection_only: bool = False


# fmt: skip below: a table of data, kept aligned row by row (the formatter would put one item per line)
ALLOWED: tuple[Allowed, ...] = (
    Allowed("comm_overlap.overlap_moe_expert_parallel_comm", (None, False), _OVERLAP),
    Allowed("model.overlap_moe_expert_parallel_comm", (None, False), _OVERLAP),
    Allowed("comm_overlap.delay_wgrad_compute", (None, False), _DELAY),
    Allowed("model.delay_wgrad_compute", (None, False), _DELAY),
    Allowed(
        "model.cuda_graph_impl", (None, "none"),
        "CUDA graphs replay captured kernels: the Python hook that adds the bias (and records the loss term) "
        "never runs on a replay",
    ),
    Allowed(
        "model.virtual_pipeline_model_parallel_size", (None, 1),
        "the interleaved (virtual) pipeline schedule runs micro-batches out of order across model chunks",
    ),
    Allowed(
        "model.pipeline_model_parallel_size", (1,),
        "with pipeline parallelism a micro-batch's forward and backward are apart by other micro-batches' work",
    ),
    Allowed("model.context_parallel_size", (1,), "context parallelism splits a sample's tokens, and their spans"),
    Allowed(
        "model.moe_router_fusion", (None, False),
        "the fused router kernel computes the top-k outside the Python router, so the bias would not choose",
    ),
    Allowed("model.mtp_num_layers", (None, 0), "the prior has no rows for the multi-token-prediction routers"),
    Allowed("model.moe_enable_routing_replay", (None, False), _REPLAY, selection_only=True),
)  # fmt: skip

#: field -> value ``build_container`` sets on every line (Bridge v0.3.1's Moonlight SFT recipe)
RUN_CONTRACT: dict[str, object] = {
    "comm_overlap.overlap_moe_expert_parallel_comm": False,
    "comm_overlap.delay_wgrad_compute": False,
    "model.overlap_moe_expert_parallel_comm": False,
    "model.delay_wgrad_compute": False,
    "model.cuda_graph_impl": "none",
    "model.virtual_pipeline_model_parallel_size": None,
    "model.moe_router_fusion": False,
    "model.moe_token_dispatcher_type": "alltoall",
    "model.moe_shared_expert_overlap": True,
    "optimizer.use_precision_aware_optimizer": True,
    "optimizer.main_params_dtype": torch.float32,
    "optimizer.main_grads_dtype": torch.bfloat16,
    "optimizer.exp_avg_dtype": torch.bfloat16,
    "optimizer.exp_avg_sq_dtype": torch.bfloat16,
    "ddp.grad_reduce_in_fp32": False,
    "mixed_precision.grad_reduce_in_fp32": False,
}


def get_path(container, path: str):
    """The value at a dotted attribute path, or ``_MISSING`` where the line has no such attribute."""
    obj = container
    for name in path.split("."):
        if obj is None:
            return _MISSING
        obj = getattr(obj, name, _MISSING)
        if obj is _MISSING:
            return _MISSING
    return obj


def enforce_contract(container) -> list[str]:
    """Set every ``RUN_CONTRACT`` field the container has; returns (and logs) what changed."""
    changed = []
    for path, value in RUN_CONTRACT.items():
        before = get_path(container, path)
        if before is _MISSING:
            continue
        owner_path, _, name = path.rpartition(".")
        setattr(get_path(container, owner_path), name, value)
        if before != value:
            changed.append(f"{path}: {before!r} -> {value!r}")
    for line in changed:
        logger.warning("rpb: set %s (rpb's run contract, Bridge v0.3.1's values; docs/megatron.md)", line)
    return changed


def container_problems(container, method: str | None = None) -> list[str]:
    """Every anchor-relevant setting of the effective container outside ``ALLOWED``, with the reason.

    ``method``: the run's ``anchor.method``; a ``selection_only`` rule is skipped for a method that keeps
    Megatron's selection. None (not told) applies every rule.
    """
    selects = method is None or get_method(method).selection is not None
    out = []
    for rule in ALLOWED:
        if rule.selection_only and not selects:
            continue
        value = get_path(container, rule.path)
        if value is not _MISSING and value not in rule.values:
            allowed = " or ".join(repr(v) for v in rule.values)
            out.append(f"{rule.path}: {value!r}; the anchor needs {allowed}: {rule.why}")
    return out


def check_container(container, where: str = "Megatron-Bridge ConfigContainer", method: str | None = None) -> None:
    problems = container_problems(container, method)
    if problems:
        raise ConfigError(where, problems)
