"""How far training's routing is from the rollout's: pure figures over completion tokens.

Shape legend: B = rollouts, S = positions of the padded batch (prompt then completion), C = completion
positions, L = MoE layers, K = top-k.

* ``flip_rate_L`` (``flips_L``, its count): per MoE layer, the share of counted tokens whose top-k *set* differs
  between two routings (the order of the k ids is no difference). Split as the literature splits it: the
  rollout against the first training forward of the batch (the engine's discrepancy), and that first forward
  against the current one in later updates of the batch (staleness).
* ``logp_gap``: the mean absolute difference between the rollout's and training's log-probability of each
  completion token, over tokens whose routing agreed in every layer and over those where it did not. Token t's
  log-probability is read at position t - 1, so its routing is position t - 1's.
"""

from __future__ import annotations

import torch


def differs_BSL(a_BSLK: torch.Tensor, b_BSLK: torch.Tensor) -> torch.Tensor:
    """True where the two routings' top-k sets differ (per position and layer)."""
    return (a_BSLK.sort(dim=-1).values != b_BSLK.sort(dim=-1).values).any(dim=-1)


def flips_L(a_BSLK: torch.Tensor, b_BSLK: torch.Tensor, count_BS: torch.Tensor) -> torch.Tensor:
    """Per layer, how many of the ``count_BS`` tokens' top-k sets differ (the count a window of batches and ranks
    sums before it divides: rpb's GRPO figures)."""
    return (differs_BSL(a_BSLK, b_BSLK) & count_BS.bool()[..., None]).sum(dim=(0, 1)).double()


def flip_rate_L(a_BSLK: torch.Tensor, b_BSLK: torch.Tensor, count_BS: torch.Tensor) -> torch.Tensor:
    """Per layer, the share of the ``count_BS`` tokens whose top-k set differs (NaN where none are counted)."""
    counted_BS = count_BS.bool()
    flipped_L = flips_L(a_BSLK, b_BSLK, counted_BS)
    return flipped_L / counted_BS.sum() if counted_BS.any() else torch.full_like(flipped_L, float("nan"))


def completion_positions(prompt_len: int, completion_mask_BC: torch.Tensor) -> torch.Tensor:
    """``count_BS`` marking the completion tokens of ``cat(prompt, completion)`` (prompt tokens never count)."""
    B = completion_mask_BC.shape[0]
    prompt_BP = completion_mask_BC.new_zeros((B, prompt_len))
    return torch.cat([prompt_BP, completion_mask_BC], dim=1).bool()


def logp_gap(
    rollout_BC: torch.Tensor,
    train_BC: torch.Tensor,
    agreed_BC: torch.Tensor,
    completion_mask_BC: torch.Tensor,
) -> dict[str, float]:
    """Mean |rollout - training| log-probability over every completion token (``all``), over those whose routing
    agreed in every layer (``agreed``) and over the others (``disagreed``); NaN for a group with no token; token
    counts beside."""
    gap_BC = (rollout_BC.double() - train_BC.double()).abs()
    mask_BC = completion_mask_BC.bool()
    out = {}
    groups = (("all", mask_BC), ("agreed", mask_BC & agreed_BC), ("disagreed", mask_BC & ~agreed_BC))
    for name, group_BC in groups:
        n = int(group_BC.sum())
        out[name] = float(gap_BC[group_BC].mean()) if n else float("nan")
        out[f"{name}_tokens"] = n
    return out


def agreed_for_completion(differs_BSL_: torch.Tensor, prompt_len: int) -> torch.Tensor:
    """``agreed_BC``: completion token c's routing (that of the position before it, which reads its
    log-probability) agreed in every layer."""
    agreed_BS = ~differs_BSL_.any(dim=-1)
    return agreed_BS[:, prompt_len - 1 : -1]
