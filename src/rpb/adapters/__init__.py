"""How to find and drive the routers of each model family (facts as data), and their fingerprint."""

from rpb.adapters.fingerprint import CheckpointRouters, checkpoint_routers_sha256, routers_sha256
from rpb.adapters.hf import (
    ADAPTERS,
    MoELayer,
    RouterFacts,
    UnsupportedModelError,
    call_router,
    chosen_experts,
    find_moe_layers,
    get_adapter,
    register_adapter,
    router_output,
    router_spec,
    running_router,
)

__all__ = [
    "ADAPTERS",
    "CheckpointRouters",
    "MoELayer",
    "RouterFacts",
    "UnsupportedModelError",
    "call_router",
    "checkpoint_routers_sha256",
    "chosen_experts",
    "find_moe_layers",
    "get_adapter",
    "register_adapter",
    "router_output",
    "router_spec",
    "routers_sha256",
    "running_router",
]
