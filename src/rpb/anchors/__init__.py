"""Anchors: what holds the base routing during post-training (RPB and the paper's comparisons)."""

from rpb.anchors.context import TokenContext
from rpb.anchors.handle import AnchorConfig, AnchorHandle, install_anchor
from rpb.anchors.methods import METHODS, Method, get_method
from rpb.anchors.verify import PriorMismatchError, RunFacts, verify_prior

__all__ = [
    "METHODS",
    "AnchorConfig",
    "AnchorHandle",
    "Method",
    "PriorMismatchError",
    "RunFacts",
    "TokenContext",
    "get_method",
    "install_anchor",
    "verify_prior",
]
