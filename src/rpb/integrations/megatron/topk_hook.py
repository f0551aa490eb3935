"""Megatron's ``router_replay`` hook as the anchor drives it, and Megatron's own routing replay beside it.

Shape legend: T = router rows, E = routed experts, K = top-k.

``topk_routing_with_score_function`` (megatron-core >= 0.16) takes its top-k from
``router_replay.get_replay_topk`` whenever the router holds a ``router_replay`` object: after the
score function (and, on sigmoid routers, on the scores plus the expert bias), in place of the plain
or group-limited top-k; the combine weights are then gathered from the live scores at the indices it
returns. Megatron's own ``RouterReplay`` (``moe_enable_routing_replay=True``) records or replays
indices there. The anchor uses the same hook twice: ``megatron_select`` runs Megatron's selection
pipeline and keeps the indices it chose, and ``forced_topk`` makes one ``routing`` call use indices
the anchor chose (rpb, the hard and shuffled controls).

A selection anchor and a routing replay cannot both choose: while ``forced_topk`` holds the hook the
router's ``RouterReplay`` neither records nor replays, and a replay that held it would override the
biased choice. So ``forced_topk`` refuses a router whose ``RouterReplay`` has an action set, and puts
the router's own object back afterwards. The loss anchors, ``router-freeze`` and ``sft`` never touch
the hook: Megatron replays under them unchanged, and their terms read the live logits.
"""

from __future__ import annotations

import contextlib

import torch
from torch import nn

from rpb.routing import RouterSpec


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


def topk_routing_function():
    """``topk_routing_with_score_function`` as ``router.py`` calls it (looked up by name, at call time)."""
    from megatron.core.transformer.moe import router as router_module

    return router_module.topk_routing_with_score_function


def selection_spec(router: nn.Module, name: str) -> RouterSpec:
    """A ``TopKRouter``'s selection rule as ``rpb.routing`` states it (what the ids-alone hinge reads). Megatron scores
    a group by the sum of its ``topk / group_topk`` best experts: DeepSeek-V3's top-2 sum at top-8 of 4 groups;
    another count the hinge cannot state, and it is refused by name (``name``: the router's, for the message)."""
    from rpb.errors import ArgumentError

    c = router.config
    groups, group_topk = c.moe_router_num_groups or 1, c.moe_router_group_topk or 1
    scoring = None
    if groups > 1:
        if router.topk // group_topk != 2:
            raise ArgumentError(
                f"router {name}: groups scored by their {router.topk // group_topk} best experts (topk "
                f"{router.topk} / moe_router_group_topk {group_topk}); anchor.routes_loss=hinge states the top-2 "
                "sum alone: use set-ce, or routes with probabilities (bucket)"
            )
        scoring = "top2-sum"
    return RouterSpec(router.score_function, router.topk, int(router.weight.shape[0]), scoring, groups, group_topk)


def megatron_select(router: nn.Module, logits_TE: torch.Tensor) -> torch.Tensor:
    """``topk_ids_TK``: the experts Megatron's own selection pipeline picks for ``logits_TE``.

    The router's score function, pre-softmax flag, expert bias and group-limited top-k, exactly
    as ``TopKRouter.routing`` passes them (never the fused kernel, which install refuses). The
    logits are detached, so no graph is built; grad mode is left as the caller has it, because
    newer megatron-core sorts its top-k only when grad is enabled, and the indices should come
    in the order the native routing would produce. The router's own ``RouterReplay`` is not
    consulted: this is the live router's choice, whatever a replay dispatches.
    """
    c = router.config
    capture = _CaptureTopK()
    topk_routing_function()(
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


def replay_action(router: nn.Module):
    """The action of the router's own ``RouterReplay`` (record, replay forward / backward), or None when
    it has none, or holds none (``moe_enable_routing_replay=False``)."""
    return getattr(getattr(router, "router_replay", None), "router_replay_action", None)


@contextlib.contextmanager
def forced_topk(router: nn.Module, ids_TK: torch.Tensor, who: str):
    """For the calls inside, Megatron's top-k of ``router`` is ``ids_TK``; the router's own
    ``router_replay`` object is put back on exit. ``who`` names the router and the method, for the error.

    Refused while the router's ``RouterReplay`` has an action: the selection would either displace the
    replay (nothing recorded, the replayed routes ignored) or, were the replay to win, lose the bias.
    """
    action = replay_action(router)
    if action is not None:
        raise RuntimeError(
            f"{who}: Megatron's routing replay is active on this router ({action}); the anchor chooses the "
            "top-k through the same router_replay hook, so the replayed routes would override its biased "
            "selection: turn the replay off (moe_enable_routing_replay=False) or use a loss anchor"
        )
    own = router.router_replay
    router.router_replay = _ForcedTopK(ids_TK)
    try:
        yield
    finally:
        router.router_replay = own
