"""The prior: the frozen base router's probabilities averaged per sample, span and MoE layer (eq. 2), the bias
RPB derives from it (eq. 3), and the file that carries it.

In pipeline order: ``math`` is the pure math (router transforms, span means, the clipped log-prior bias; tensor
in, tensor out, nothing of rpb imported); ``artifact`` is the safetensors file (atomic and streamed writes, the
memory-mapped load); ``checks`` is what the file must hold, checked on the file alone, and ``load_prior``, which
every command that reads a prior goes through. ``rpb collect`` (``rpb.collect``) writes the file; the checks
against a data file and a model (``rpb validate``) live in ``rpb.train.validate``, beside the dry run that runs
them, since they read the data, the anchors and the adapters, which all import the math here.

The math's names are re-exported here, where the rest of rpb imports them from; the math pulls only torch.
"""

from rpb.prior.math import (
    DEFAULT_CLIP,
    DEFAULT_EPS,
    NUM_SPANS,
    PRIOR_KINDS,
    ROUTER_TRANSFORMS,
    SPAN_A,
    SPAN_NAMES,
    SPAN_Q,
    STRUCTURAL,
    PriorKind,
    RouterTransform,
    clip_prior,
    clipped_share,
    family_transform,
    log_prior_bias,
    router_probs,
    selection_sums,
    span_counts,
    span_means,
    span_sums,
)

__all__ = [
    "DEFAULT_CLIP",
    "DEFAULT_EPS",
    "NUM_SPANS",
    "PRIOR_KINDS",
    "ROUTER_TRANSFORMS",
    "SPAN_A",
    "SPAN_NAMES",
    "SPAN_Q",
    "STRUCTURAL",
    "PriorKind",
    "RouterTransform",
    "clip_prior",
    "clipped_share",
    "family_transform",
    "log_prior_bias",
    "router_probs",
    "selection_sums",
    "span_counts",
    "span_means",
    "span_sums",
]
