"""Anchors: what holds the base routing during post-training (RPB and the paper's comparisons).

``methods`` is the table of methods (one entry each), ``config`` the ``anchor.*`` settings,
``handle`` installs a method into a Hugging Face model's routers (reversibly), ``context``
carries each step's per-token (sample, span), ``prior_routing`` turns the prior into a step's
bias or forced top-k, ``controls`` builds the shuffled controls, ``verify`` checks a prior
against the run about to use it, ``transform`` chooses the run's one router transform.
"""

from rpb.anchors.config import AnchorConfig
from rpb.anchors.context import TokenContext
from rpb.anchors.handle import AnchorHandle, install_anchor
from rpb.anchors.methods import METHODS, LossAnchor, Method, RouterState, get_method, methods_table, register_method
from rpb.anchors.verify import PriorMismatchError, RunFacts, verify_prior

__all__ = [
    "METHODS",
    "AnchorConfig",
    "AnchorHandle",
    "LossAnchor",
    "Method",
    "PriorMismatchError",
    "RouterState",
    "RunFacts",
    "TokenContext",
    "get_method",
    "install_anchor",
    "methods_table",
    "register_method",
    "verify_prior",
]
