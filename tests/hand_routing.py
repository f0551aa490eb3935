"""Expert selection written out from the transformers source, for tests to compare rpb against.

Qwen3-MoE: softmax, then top-k. DeepSeek-V3 with one expert group (the tiny Moonlight): sigmoid
plus the expert-correction bias, then top-k. The bias is eq. 3 computed directly from a prior row.
Nothing here imports rpb.
"""

from __future__ import annotations

import torch

EPS, C = 0.05, 5.0


def hand_bias(pi_E: torch.Tensor) -> torch.Tensor:
    """Eq. 3: b = log q - mean log q, q = clamp(pi, eps/E, C/E) renormalised."""
    E = pi_E.numel()
    q = pi_E.double().clamp(EPS / E, C / E)
    log_q = (q / q.sum()).log()
    return (log_q - log_q.mean()).float()


def hand_select(z_TE: torch.Tensor, bias_TE: torch.Tensor, k: int, expert_bias_E=None) -> list[frozenset]:
    """The chosen expert sets: softmax top-k, or (with ``expert_bias_E``) DeepSeek-V3's sigmoid + bias."""
    if expert_bias_E is None:
        choice_TE = torch.softmax((z_TE + bias_TE).float(), dim=-1)
    else:
        choice_TE = torch.sigmoid((z_TE + bias_TE).float()) + expert_bias_E
    return [frozenset(r) for r in choice_TE.topk(k, dim=-1).indices.tolist()]


def token_bias(pi: torch.Tensor, layer: int, sample_T: torch.Tensor, span_T: torch.Tensor, beta: float):
    """beta * b[x, s, layer] for every content token (span >= 0, sample >= 0), zero elsewhere."""
    E = pi.shape[-1]
    rows = [
        beta * hand_bias(pi[x, s, layer]) if x >= 0 and s >= 0 else torch.zeros(E)
        for x, s in zip(sample_T.tolist(), span_T.tolist(), strict=True)
    ]
    return torch.stack(rows)
