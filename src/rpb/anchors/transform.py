"""The router transform of a run: one per run, read by ``kl-to-base`` and the routing monitor alike.

Which distribution p(e | x) a run reads its router logits as (``rpb.prior.router_probs``): an explicit
``anchor.router_transform`` first, else the prior's (the transform it was collected under), else the
family's own: the normalised sigmoid for the routers that score experts with a sigmoid (DeepSeek-V3,
Kimi-K2, GLM-4.5, MiniMax-M2, Moonlight), softmax for the others.
"""

from __future__ import annotations

import logging

from rpb.prior import family_transform

logger = logging.getLogger("rpb.anchors")


def run_transform(override: str | None, prior: str | None, score_function: str) -> str:
    """The run's transform (the module doc's order). An override that differs from the prior's is kept,
    and said once: the prior stays valid (its routing does not depend on it), but ``kl-to-base`` and the
    monitor then read the routers otherwise than the prior was collected."""
    if override is not None:
        if prior is not None and prior != override:
            logger.warning(
                "rpb: anchor.router_transform=%s overrides the prior's transform %s: kl-to-base and the routing "
                "monitor read the routers as %s",
                override,
                prior,
                override,
            )
        return override
    return prior if prior is not None else family_transform(score_function)
