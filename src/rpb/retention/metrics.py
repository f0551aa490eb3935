"""Pure retention metrics (tensor in, number or tensor out).

Shape legend: T = tokens, K = top-k, E = experts, L = MoE layers.
Divergences compare per-expert *utilization shares* (fraction of top-k selections);
entropy and JSD are in bits. Library implementations are used where they exist (scipy, torch).
"""

from __future__ import annotations

import math

import numpy as np
import torch


def shares(counts_E: torch.Tensor) -> np.ndarray:
    """Counts -> shares summing to 1 (float64)."""
    c = np.asarray(counts_E, dtype=np.float64)
    total = c.sum()
    if total <= 0:
        raise ValueError("empty selection: no routed tokens were counted")
    return c / total


def tvd(p_E, q_E) -> float:
    """Total variation distance, 0.5 * sum |p - q|, in [0, 1]."""
    return 0.5 * float(np.abs(np.asarray(p_E) - np.asarray(q_E)).sum())


def jsd_bits(p_E, q_E) -> float:
    """Jensen-Shannon divergence in bits (scipy returns its square root, the JS distance)."""
    from scipy.spatial.distance import jensenshannon  # here: scipy costs every process that imports rpb a second

    return float(jensenshannon(np.asarray(p_E), np.asarray(q_E), base=2) ** 2)


def entropy_bits(weights, dim: int = -1) -> torch.Tensor:
    """Entropy in bits of the distribution(s) along ``dim`` of ``weights`` (counts or probabilities:
    normalised here), in float64; 0 log 0 = 0. Utilization, prior and training-time load alike."""
    w = torch.as_tensor(weights, dtype=torch.float64)
    return torch.special.entr(w / w.sum(dim, keepdim=True)).sum(dim) / math.log(2)


def topk_overlap_T(ids_a_TK: torch.Tensor, ids_b_TK: torch.Tensor, num_experts: int) -> torch.Tensor:
    """|top_k^a(x_t) ∩ top_k^b(x_t)| / k for every token, from one-hot sets (no loop over tokens)."""
    if ids_a_TK.shape != ids_b_TK.shape:
        raise ValueError(f"top-k shapes differ: {tuple(ids_a_TK.shape)} vs {tuple(ids_b_TK.shape)}")
    T, K = ids_a_TK.shape
    a_TE = torch.zeros(T, num_experts, dtype=torch.bool, device=ids_a_TK.device).scatter_(1, ids_a_TK, True)
    b_TE = torch.zeros(T, num_experts, dtype=torch.bool, device=ids_b_TK.device).scatter_(1, ids_b_TK, True)
    return (a_TE & b_TE).sum(dim=-1).to(torch.float64) / K
