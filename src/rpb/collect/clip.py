"""What the clip does to a collected prior: the share of (row, expert) pairs it lifts, per span and layer.

A frequency prior gives 0 to every expert a span's tokens never chose, and the clip lifts each of those to
``eps / E`` (``rpb.prior.clip_prior``): the bias then says "rare" where the data only says "unseen". The share
says how much of the bias that is; a probability prior's is rarely above 0. Read block by block, so a
memory-mapped prior far larger than memory is read without a copy.
"""

from __future__ import annotations

import torch

from rpb.prior import DEFAULT_EPS, SPAN_NAMES, clipped_share

#: rows read at a time
BLOCK_ROWS = 4096


def clipped_shares(prior_NSLE: torch.Tensor, eps: float = DEFAULT_EPS) -> torch.Tensor:
    """``share_SL`` over every row of ``prior_NSLE``, read ``BLOCK_ROWS`` rows at a time."""
    total_SL = torch.zeros(prior_NSLE.shape[1:3], dtype=torch.float64)
    for start in range(0, prior_NSLE.shape[0], BLOCK_ROWS):
        block = prior_NSLE[start : start + BLOCK_ROWS]
        total_SL += clipped_share(block, eps).double() * block.shape[0]
    return (total_SL / max(prior_NSLE.shape[0], 1)).float()


def clip_table(share_SL: torch.Tensor, moe_layers: list[int], kind: str, eps: float = DEFAULT_EPS) -> str:
    """The shares as lines to print: one per span, each MoE layer's share in percent."""
    lines = [f"{kind} prior: share of (row, expert) lifted by the clip (prior < eps/E, eps {eps:g}), per layer:"]
    for s, name in enumerate(SPAN_NAMES):
        values = " ".join(f"{100 * float(v):.1f}%" for v in share_SL[s])
        lines.append(f"  span {name}: layers {moe_layers[0]}..{moe_layers[-1]}: {values}")
    return "\n".join(lines)
