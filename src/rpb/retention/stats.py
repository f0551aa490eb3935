"""Streaming routing statistics: O(layers x experts^2) memory whatever the number of tokens.

Shape legend: T = tokens, K = top-k, E = experts, L = MoE layers, S = token subsets
(0 = all non-padding tokens, 1 = Q content, 2 = A content).
"""

from __future__ import annotations

import torch

from rpb.prior import SPAN_A, SPAN_Q
from rpb.retention.communities import CoactivationAccumulator
from rpb.retention.metrics import topk_overlap_T
from rpb.retention.transitions import StepTransitionAccumulator, TransitionAccumulator

SUBSETS = ("all", "Q", "A")


def subset_masks(valid_T: torch.Tensor, span_T: torch.Tensor) -> list[torch.Tensor]:
    return [valid_T, valid_T & (span_T == SPAN_Q), valid_T & (span_T == SPAN_A)]


class ModelRouting:
    """One model's utilization counts per subset and co-activation counts, per MoE layer."""

    def __init__(self, num_layers: int, num_experts: int, transitions: bool = False, steps: bool = False):
        self.num_experts = num_experts
        self.load_SLE = torch.zeros(len(SUBSETS), num_layers, num_experts, dtype=torch.float64)
        self.tokens_S = torch.zeros(len(SUBSETS), dtype=torch.int64)
        self.coactivation = CoactivationAccumulator(num_layers, num_experts)
        self.transitions = TransitionAccumulator(num_layers, num_experts) if transitions else None
        self.step_transitions = StepTransitionAccumulator(num_layers, num_experts) if steps else None

    def add(
        self,
        pos: int,
        ids_TK: torch.Tensor,
        valid_T: torch.Tensor,
        span_T: torch.Tensor,
        rows: int = 1,
        step_BT: torch.Tensor | None = None,
    ) -> None:
        """One layer's routing of a batch of ``rows`` rows flattened row-major (transitions need the rows)."""
        for s, mask_T in enumerate(subset_masks(valid_T, span_T)):
            ids = ids_TK[mask_T].reshape(-1)
            self.load_SLE[s, pos] += torch.bincount(ids, minlength=self.num_experts).cpu().double()
            if pos == 0:
                self.tokens_S[s] += int(mask_T.sum())
        self.coactivation.add(pos, ids_TK, valid_T)
        if self.transitions is not None:
            self.transitions.add(
                pos, ids_TK.view(rows, -1, ids_TK.shape[-1]), valid_T.view(rows, -1), span_T.view(rows, -1)
            )
        if self.step_transitions is not None:
            self.step_transitions.add(pos, ids_TK.view(rows, -1, ids_TK.shape[-1]), step_BT, span_T.view(rows, -1))


class PairedOverlap:
    """Sum over tokens of the top-k overlap between two models, per subset and layer."""

    def __init__(self, num_layers: int, num_experts: int):
        self.num_experts = num_experts
        self.sum_SL = torch.zeros(len(SUBSETS), num_layers, dtype=torch.float64)
        self.count_SL = torch.zeros(len(SUBSETS), num_layers, dtype=torch.int64)

    def add(self, pos: int, ids_a_TK, ids_b_TK, valid_T, span_T) -> None:
        overlap_T = topk_overlap_T(ids_a_TK, ids_b_TK, self.num_experts)
        for s, mask_T in enumerate(subset_masks(valid_T, span_T)):
            self.sum_SL[s, pos] += float(overlap_T[mask_T].sum())
            self.count_SL[s, pos] += int(mask_T.sum())

    def mean_SL(self) -> torch.Tensor:
        return self.sum_SL / self.count_SL.clamp_min(1)
