"""Pure prior math (tensor in, tensor out): paper eq. 2 and eq. 3.

Shape legend for the suffixes on tensor names:
  B = batch rows, T = token positions, E = routed experts, S = spans (0 = Q, 1 = A),
  L = MoE layers, N = samples (rows of the data file).

Nothing here knows about models, files or tokenizers.
"""

from __future__ import annotations

from typing import Literal, get_args

import torch

#: Span ids used on every per-token label tensor. Structural and padding tokens are -1.
SPAN_Q = 0
SPAN_A = 1
STRUCTURAL = -1
NUM_SPANS = 2
SPAN_NAMES = ("Q", "A")

#: Router transforms p_base(e | x_t) that a prior may be collected under.
RouterTransform = Literal["softmax", "sigmoid-normalized"]
ROUTER_TRANSFORMS: tuple[str, ...] = get_args(RouterTransform)

DEFAULT_EPS = 0.05
DEFAULT_CLIP = 5.0

#: what a prior averages over a span's tokens: the router's probabilities (eq. 2, the paper's prior, what an HF
#: forward gives), or its selection (the share of the span's tokens that chose each expert, divided by top-k so a
#: row sums to 1: what an inference engine's routes give, since no engine returns the probabilities)
PriorKind = Literal["probability", "frequency"]
PRIOR_KINDS: tuple[str, ...] = get_args(PriorKind)


def router_probs(logits_TE: torch.Tensor, transform: str) -> torch.Tensor:
    """Map raw router logits z to a distribution over experts, in float32.

    ``softmax``: softmax(z), the paper's definition of p_base.
    ``sigmoid-normalized``: sigmoid(z_e) / sum_e' sigmoid(z_e'), for sigmoid routers
    (DeepSeek-V3 / Moonlight) read as a distribution. Neither transform reads an
    expert-correction bias: the prior describes the router, not its load balancer.
    """
    z = logits_TE.float()
    if transform == "softmax":
        return torch.softmax(z, dim=-1)
    if transform == "sigmoid-normalized":
        s = torch.sigmoid(z)
        return s / s.sum(dim=-1, keepdim=True)
    raise ValueError(f"unknown router transform {transform!r}; choose one of {ROUTER_TRANSFORMS}")


def family_transform(score_function: str) -> str:
    """The transform of a family whose routers score experts with ``score_function``: a sigmoid router's
    scores are independent per expert, so normalising them is the distribution it routes by; softmax
    otherwise."""
    return "sigmoid-normalized" if score_function == "sigmoid" else "softmax"


def span_sums(probs_BTE: torch.Tensor, span_BT: torch.Tensor) -> torch.Tensor:
    """Per-row, per-span sums of token probabilities: ``sums_BSE`` (float32).

    ``span_BT`` holds SPAN_Q / SPAN_A for content tokens and STRUCTURAL (-1) for the
    rest, padding included, which therefore never counts.
    """
    onehot_BTS = torch.stack([span_BT == s for s in range(NUM_SPANS)], dim=-1).to(torch.float32)
    return torch.einsum("bts,bte->bse", onehot_BTS, probs_BTE.float())


def selection_sums(ids_BTK: torch.Tensor, span_BT: torch.Tensor, num_experts: int) -> torch.Tensor:
    """Per-row, per-span sums of the tokens' selections, each token's top-k counting 1/k per chosen expert:
    ``sums_BSE`` (float32). Divided by the span's token count (``span_counts``) it is the frequency prior, whose
    rows sum to 1 as a probability prior's do. ``span_BT`` as for ``span_sums``: padding never counts."""
    top_k = ids_BTK.shape[-1]
    chosen_BTE = torch.zeros(*ids_BTK.shape[:2], num_experts, dtype=torch.float32, device=ids_BTK.device)
    chosen_BTE.scatter_(-1, ids_BTK.long(), 1.0 / top_k)
    return span_sums(chosen_BTE, span_BT)


def clipped_share(prior_NSLE: torch.Tensor, eps: float = DEFAULT_EPS) -> torch.Tensor:
    """``share_SL``: the share of (row, expert) pairs the clip lifts (prior below ``eps / E``), per span and layer.
    A frequency prior's never-chosen experts are all lifted; a probability prior's rarely are."""
    num_experts = prior_NSLE.shape[-1]
    return (prior_NSLE.float() < eps / num_experts).float().mean(dim=(0, 3))


def span_counts(span_BT: torch.Tensor) -> torch.Tensor:
    """Tokens per row and span: ``counts_BS`` (int64)."""
    return torch.stack([(span_BT == s).sum(dim=1) for s in range(NUM_SPANS)], dim=-1).to(torch.int64)


def span_means(probs_BTE: torch.Tensor, span_BT: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Eq. 2: pi[x, s, e] = mean over the tokens t of span s of p_base(e | x_t).

    Returns ``(pi_BSE, counts_BS)``. A span without tokens gets NaN, which the
    data layer makes impossible (such rows are rejected before any compute).
    """
    counts_BS = span_counts(span_BT)
    return span_sums(probs_BTE, span_BT) / counts_BS.unsqueeze(-1).to(torch.float32), counts_BS


def clip_prior(pi_E: torch.Tensor, eps: float = DEFAULT_EPS, clip: float = DEFAULT_CLIP) -> torch.Tensor:
    """Clamp each expert's prior to [eps/E, C/E] and renormalise over experts (last axis)."""
    num_experts = pi_E.shape[-1]
    if not 0 < eps <= 1 <= clip:
        raise ValueError(f"need 0 < eps <= 1 <= C, got eps={eps}, C={clip}")
    q = pi_E.float().clamp(eps / num_experts, clip / num_experts)
    return q / q.sum(dim=-1, keepdim=True)


def log_prior_bias(pi_E: torch.Tensor, eps: float = DEFAULT_EPS, clip: float = DEFAULT_CLIP) -> torch.Tensor:
    """Eq. 3: b = log q - mean_e log q, with q the clipped, renormalised prior.

    Works on any leading shape (e.g. pi_NSLE -> b_NSLE); the last axis is experts.
    The clip keeps the bias finite (|b| <= log(C/eps)); centring makes it a relative
    preference, so adding it to logits does not move their mean.
    """
    log_q = clip_prior(pi_E, eps, clip).log()
    return log_q - log_q.mean(dim=-1, keepdim=True)
