"""The routing overlap with the base that ``routing-kd`` holds: per optimizer step, what a routing target is measured
by (``rpb.anchors.target``) and what every trainer logs as ``anchor/overlap``.

Shape legend: T = the step's tokens (flattened), E = experts, K = top-k, L = MoE layers.

For each MoE layer, each counted token adds ``|S ∩ S_base| / k``: S the model's top-k set as its router returned it
(the family's own selection: scores, correction bias, groups), S_base the base's, chosen by the same rule from the
base's own forward's logits (with the base router's frozen correction bias), or read from stored routes. The tokens
counted are the ones ``routing-kd``'s term averages: non-padding, and in GRPO the completion tokens the reference
routing covers (``BaseRouting.known_T``). The counts of every micro-batch of an optimizer step add up; the trainer
sums them over ranks (``flat`` / ``from_flat``) and reads ``measure``: the mean over layers of each layer's token
mean (m, ``anchor/overlap``) and the worst layer's (``anchor/overlap_min``).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from rpb.routing import RouterSpec, select_with_groups


def base_topk(base, pos: int, spec: RouterSpec, expert_bias_E: torch.Tensor | None, device) -> torch.Tensor:
    """The base's top-k ids ``[T, K]`` at MoE layer ``pos`` of the step's ``BaseRouting``."""
    if base.logits_LTE is not None:
        logits_TE = base.logits_LTE[pos].to(device)
        bias = None if expert_bias_E is None else expert_bias_E.to(device)
        return select_with_groups(logits_TE, spec, expert_bias_E=bias)[0]
    return base.ids_LTK[pos].to(device)


@torch.no_grad()
def shared_share(model_ids_TK: torch.Tensor, base_ids_TK: torch.Tensor, counted_T: torch.Tensor) -> tuple[float, int]:
    """``(sum over the counted tokens of |S ∩ S_base| / k, how many were counted)``."""
    k = model_ids_TK.shape[-1]
    shared_T = (model_ids_TK[:, :, None] == base_ids_TK[:, None, :]).any(-1).sum(-1).double() / k
    return float(shared_T[counted_T].sum()), int(counted_T.sum())


@dataclass
class OverlapCounts:
    """One optimizer step's counts per MoE layer (position in the handle's layers): the summed shares and tokens."""

    num_layers: int
    shared_L: torch.Tensor = field(init=False)
    tokens_L: torch.Tensor = field(init=False)

    def __post_init__(self):
        self.reset()

    def reset(self) -> None:
        self.shared_L = torch.zeros(self.num_layers, dtype=torch.float64)
        self.tokens_L = torch.zeros(self.num_layers, dtype=torch.float64)

    def add(self, pos: int, shared: float, tokens: int) -> None:
        self.shared_L[pos] += shared
        self.tokens_L[pos] += tokens

    def count(self, pos: int, base, spec: RouterSpec, expert_bias_E, model_ids_TK, weight_T: torch.Tensor) -> None:
        """One router call's counts: the tokens the term weighs (``weight_T`` > 0) that the base's routing covers."""
        counted_T = weight_T > 0
        if base.known_T is not None:
            counted_T = counted_T & base.known_T.to(counted_T.device)
        base_ids_TK = base_topk(base, pos, spec, expert_bias_E, model_ids_TK.device)
        self.add(pos, *shared_share(model_ids_TK, base_ids_TK, counted_T))

    def flat(self) -> torch.Tensor:
        """``[2 * L]`` float64: the counts as one tensor, for a sum over ranks."""
        return torch.cat([self.shared_L, self.tokens_L])

    def from_flat(self, flat: torch.Tensor) -> None:
        self.shared_L, self.tokens_L = flat[: self.num_layers].clone(), flat[self.num_layers :].clone()

    def measure(self) -> tuple[float, float] | None:
        """``(m, the worst layer's)`` over the layers that counted a token; None where none did."""
        seen = self.tokens_L > 0
        if not bool(seen.any()):
            return None
        per_layer = self.shared_L[seen] / self.tokens_L[seen]
        return float(per_layer.mean()), float(per_layer.min())
