"""Predictive routing replay (PR2, arXiv 2606.00395; reference: radixark/miles, ``predictive_router_*.py``): a
linear predictor per router learns how the router's logits drift between the first training-side forward of a
generation batch and the later updates that reuse it, so the routes recorded in that first forward anticipate the
drift instead of replaying the past.

Shape legend: B = rollouts, C = completion positions, L = MoE layers, H = a router's input width, E = routed
experts, T = flattened tokens.

* ``RoutePredictor``: one ``Linear(H, E, bias=False)`` per MoE layer, zero at the start (so PR2 starts as R2), in
  float32 whatever the model's dtype. It lives beside the model, never inside it: the model's saved weights and
  its parameters' gradients know nothing of it.
* ``predictor_loss``: per layer, the mean over the counted tokens of KL(stop-grad live || transform(recorded +
  delta)) -- the reference's ``kl-post`` -- summed over layers. The recorded logits and inputs are the first
  forward's; the live logits the training forward's; the transform the run's router transform
  (``rpb.losses.router_probs``; the reference takes a softmax whatever the router). Only the predictor has a
  gradient: the live logits are detached and the recorded tensors carry none, so the router's gradient is R2's.

Not built (the reference's optional stabilisers, off by default there): depth-decayed gating of the delta, its
magnitude and top-k-margin clips, hidden-shift and boundary-margin loss weights, the flip fallback.
"""

from __future__ import annotations

import torch
from torch import nn
from torch.nn.utils import skip_init

from rpb.losses import kl_to_base


class RoutePredictor(nn.Module):
    """``delta(pos, input_TH)``: MoE layer ``pos``'s predicted logit drift ``[T, E]`` (float32)."""

    def __init__(self, widths: list[int], experts: list[int]):
        super().__init__()
        # skip_init: no draw from the global RNG, so a PR2 run samples the rollouts an R2 run of its seed samples
        pairs = zip(widths, experts, strict=True)
        self.linears = nn.ModuleList(skip_init(nn.Linear, h, e, bias=False) for h, e in pairs)
        for linear in self.linears:
            nn.init.zeros_(linear.weight)

    def delta(self, pos: int, input_TH: torch.Tensor) -> torch.Tensor:
        linear = self.linears[pos]
        return linear(input_TH.to(device=linear.weight.device, dtype=linear.weight.dtype))


def predictor_loss(
    predictor: RoutePredictor,
    inputs_BCLH: torch.Tensor,
    recorded_BCLE: torch.Tensor,
    live_BCLE: torch.Tensor,
    count_BC: torch.Tensor,
    transform: str,
) -> torch.Tensor:
    """Sum over MoE layers of the mean over ``count_BC``'s tokens of KL(sg(live) || transform(recorded + delta))."""
    valid_T = count_BC.reshape(-1).bool()
    total = torch.zeros((), device=predictor.linears[0].weight.device)
    for pos in range(recorded_BCLE.shape[2]):
        input_TH = inputs_BCLH[:, :, pos].reshape(-1, inputs_BCLH.shape[-1]).detach()
        recorded_TE = recorded_BCLE[:, :, pos].reshape(-1, recorded_BCLE.shape[-1]).detach().float()
        live_TE = live_BCLE[:, :, pos].reshape(-1, live_BCLE.shape[-1]).detach().float()
        delta_TE = predictor.delta(pos, input_TH)
        total = total + kl_to_base(
            recorded_TE.to(delta_TE.device) + delta_TE,
            live_TE.to(delta_TE.device),
            valid_T.to(delta_TE.device),
            transform,
        )
    return total
