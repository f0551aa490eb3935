"""The anchors on Megatron-Core routers (the paper-scale path), with megatron-core as an optional extra.

Importing this package needs no megatron: megatron-core is imported when a model's routers
are found (``install_megatron_anchor``), Megatron-Bridge only by ``bridge.run_training``.
Install the extra with ``pip install 'rpb[megatron]'`` (keep your torch pinned).

Usage inside a Megatron training loop (pipeline-parallel size 1)::

    handle = install_megatron_anchor(model_chunks, AnchorConfig(method="rpb"), prior=artifact.prior_qa)
    # per micro-batch, before its forward; stays set through its backward
    handle.set_micro_batch(sample_index_BS, span_BS)
    ...
    handle.remove()

The loss-based anchors (lbl, router-l2, kl-to-base, logit-l2) add ``handle.loss()`` in the
forward step's loss function, after the forward (``bridge.anchored_loss`` does it for Bridge).
"""

from rpb.integrations.megatron.install import find_topk_routers, freeze_router_parameters, install_megatron_anchor
from rpb.integrations.megatron.layout import ROUTED_ALL_BUT_LAST, ROUTED_ALL_POSITIONS, pack_thd, router_rows
from rpb.integrations.megatron.router import MegatronAnchorError, MegatronAnchorHandle, MegatronRouter, megatron_select
from rpb.integrations.megatron.verify import megatron_routers_sha256, megatron_run_facts, verify_megatron_prior

__all__ = [
    "ROUTED_ALL_BUT_LAST",
    "ROUTED_ALL_POSITIONS",
    "MegatronAnchorError",
    "MegatronAnchorHandle",
    "MegatronRouter",
    "find_topk_routers",
    "freeze_router_parameters",
    "install_megatron_anchor",
    "megatron_routers_sha256",
    "megatron_run_facts",
    "megatron_select",
    "pack_thd",
    "router_rows",
    "verify_megatron_prior",
]
