"""How to find and drive the routers of each model family (facts as data)."""

from rpb.adapters.hf import (
    ADAPTERS,
    MoELayer,
    RouterFacts,
    UnsupportedModelError,
    find_moe_layers,
    get_adapter,
    register_adapter,
    routers_sha256,
)

__all__ = [
    "ADAPTERS",
    "MoELayer",
    "RouterFacts",
    "UnsupportedModelError",
    "find_moe_layers",
    "get_adapter",
    "register_adapter",
    "routers_sha256",
]
