"""How GRPO aggregates its per-token loss, for each ``loss_type``, as weights an anchor's token term can share.

Shape legend: B = completions of one micro-batch, C = completion positions.

TRL's ``GRPOTrainer._compute_loss`` turns ``per_token_loss_BC`` into one number per micro-batch as
``sum(per_token_loss_BC * w_BC)`` with these weights (training mode, ``A`` = gradient-accumulation steps):

| ``loss_type`` | ``w_BC`` on completion tokens (``mask_BC``) |
|---|---|
| ``grpo``, ``sapo`` | 1 / (the completion's length x B x A): the mean per sequence, then over sequences |
| ``bnpo`` | 1 / (the micro-batch's tokens x A) |
| ``dr_grpo`` | 1 / (B x ``max_completion_length`` x A) |
| ``dapo``, ``cispo``, ``vespo`` | 1 / (``num_items_in_batch`` / processes x A / ``steps_per_generation``) |
| ``luspo`` | 1 / (B x A): the sum per sequence, then the mean over sequences |

The token anchors (``kl-to-base``, ``logit-l2``, ``lbl``) are averaged over the completion tokens with the
same weights, so that a coefficient means the same share of the loss as GRPO's own terms, whatever the
``loss_type`` and the accumulation. ``router-l2``, a term on the weights, is added once per optimizer step:
1 / A of it in each micro-batch. A ``loss_type`` missing here is refused, never scaled as another.
"""

from __future__ import annotations

import re

import torch

#: loss_type -> how its per-token loss is normalised (the weights' denominator, before ``A``)
SCALING = {
    "grpo": "sequence-mean",
    "sapo": "sequence-mean",
    "bnpo": "batch-tokens",
    "dr_grpo": "constant",
    "dapo": "global-tokens",
    "cispo": "global-tokens",
    "vespo": "global-tokens",
    "luspo": "sequence-sum",
}


def documented_loss_types(help_text: str) -> set[str]:
    """The ``loss_type`` values GRPOConfig's help text lists ("Supported values are 'a', 'b', ..., and 'z'.")."""
    match = re.search(r"Supported values are (.*?)\.\s", help_text)
    return set(re.findall(r"'([a-z_]+)'", match.group(1))) if match else set()


def token_weights_BC(
    loss_type: str,
    mask_BC: torch.Tensor,
    *,
    accumulation: int,
    max_completion_length: int,
    num_items_in_batch: torch.Tensor | float | None = None,
    num_processes: int = 1,
    steps_per_generation: int = 1,
) -> torch.Tensor:
    """``w_BC``: the weight GRPO's ``loss_type`` gives each completion token of this micro-batch (0 off the mask)."""
    kind = SCALING[loss_type]
    mask_BC = mask_BC.double()
    B = mask_BC.shape[0]
    if kind == "sequence-mean":
        per_token_BC = mask_BC / mask_BC.sum(-1, keepdim=True).clamp(min=1.0) / B
    elif kind == "batch-tokens":
        per_token_BC = mask_BC / mask_BC.sum().clamp(min=1.0)
    elif kind == "constant":
        per_token_BC = mask_BC / (B * max_completion_length)
    elif kind == "sequence-sum":
        per_token_BC = mask_BC / B
    else:  # global-tokens: TRL's num_items_in_batch spans the generation batch, rescaled to one window
        items = torch.as_tensor(num_items_in_batch, dtype=torch.float64).clamp(min=1.0) / num_processes
        per_token_BC = mask_BC / (items * accumulation / steps_per_generation)
        return per_token_BC
    return per_token_BC / accumulation
