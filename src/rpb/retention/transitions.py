"""Routing transition communities: which experts *follow* which, token to token, inside answers.

The static co-activation graph (eq. 1) says which experts fire together on one token. For long
reasoning traces the structure may instead be sequential: a run of tokens routed to one group of
experts hands over to another group. Per MoE layer, a directed graph counts those hand-overs:

  W[e, e'] += 1  for every e in S_t and e' in S_{t+1},

for consecutive answer tokens t, t+1 of one row (k² pairs per step; nothing crosses rows, spans or
padding). The diagonal -- an expert that persists -- is kept, and its share is reported. W is
normalised as eq. 1 is, by the number of steps counted. Communities come from networkx's Louvain
on the *directed* graph (``communities.louvain(..., directed=True)``: directed modularity); nothing is
symmetrised.

Step level (``--steps-by REGEX``): an answer is cut into steps where the regex matches (a delimiter
token belongs to the step it ends); each step's expert usage u_j (its selections, normalised) and the
next step's in the same answer add the outer product u_j u_{j+1}ᵀ.

Shape legend: B rows, T positions, K top-k, E experts, L MoE layers, J steps.
"""

from __future__ import annotations

import re

import torch

from rpb.prior import SPAN_A
from rpb.retention.metrics import jsd_bits


def transition_counts(ids_BTK: torch.Tensor, valid_BT: torch.Tensor, span_BT: torch.Tensor, num_experts: int):
    """``(counts_EE, steps)``: expert-set transitions between consecutive answer tokens of each row (float64)."""
    if ids_BTK.dim() != 3:
        raise ValueError(f"indices must be [B, T, K], got shape {tuple(ids_BTK.shape)}")
    keep_BT = valid_BT.bool() & (span_BT == SPAN_A)
    step_BT = keep_BT[:, :-1] & keep_BT[:, 1:]  # t and t+1 both answer tokens of the row
    B, T, _ = ids_BTK.shape
    onehot_BTE = torch.zeros(B, T, num_experts, dtype=torch.float64, device=ids_BTK.device)
    onehot_BTE.scatter_(2, ids_BTK.long().clamp(0, num_experts - 1), 1.0)
    src_SE, dst_SE = onehot_BTE[:, :-1][step_BT], onehot_BTE[:, 1:][step_BT]
    return src_SE.T @ dst_SE, int(step_BT.sum())


class TransitionAccumulator:
    """Running per-layer transition counts: O(L * E^2) memory, whatever the number of tokens."""

    def __init__(self, num_layers: int, num_experts: int) -> None:
        self.num_experts = num_experts
        self.counts_LEE = torch.zeros(num_layers, num_experts, num_experts, dtype=torch.float64)
        self.steps_L = torch.zeros(num_layers, dtype=torch.int64)

    def add(self, pos: int, ids_BTK: torch.Tensor, valid_BT: torch.Tensor, span_BT: torch.Tensor) -> None:
        counts_EE, steps = transition_counts(ids_BTK, valid_BT, span_BT, self.num_experts)
        self.counts_LEE[pos] += counts_EE.cpu()
        self.steps_L[pos] += steps

    def merge(self, other: TransitionAccumulator) -> TransitionAccumulator:
        self.counts_LEE += other.counts_LEE
        self.steps_L += other.steps_L
        return self

    def graph(self, pos: int) -> torch.Tensor:
        """W of one layer: counts over steps, diagonal kept; raises ValueError ("empty selection") without steps."""
        steps = int(self.steps_L[pos])
        if steps <= 0:
            raise ValueError("empty selection: no consecutive answer tokens to count transitions over")
        return self.counts_LEE[pos] / steps


def self_share(weights_EE: torch.Tensor) -> float:
    """The diagonal's share of W: transitions in which an expert stays selected."""
    total = float(weights_EE.sum())
    return float(weights_EE.diagonal().sum()) / total if total > 0 else float("nan")


def transition_tvd(w_base_EE: torch.Tensor, w_post_EE: torch.Tensor) -> float:
    """TVD between the two W normalised to distributions over the E² transitions."""
    p, q = w_base_EE / w_base_EE.sum(), w_post_EE / w_post_EE.sum()
    return float(0.5 * (p - q).abs().sum())


def transition_row_jsd(w_base_EE: torch.Tensor, w_post_EE: torch.Tensor, util_base_E: torch.Tensor) -> float:
    """Σ_i π_base(i) · JSD(P_base(i, ·), P_post(i, ·)) in bits, P = W row-normalised, π_base the base's
    utilization; rows either model never leaves are skipped and π renormalised over the rest."""
    out_b, out_p = w_base_EE.sum(1), w_post_EE.sum(1)
    rows = torch.nonzero((out_b > 0) & (out_p > 0)).flatten().tolist()
    weights = util_base_E.double()[rows]
    if not rows or float(weights.sum()) == 0:
        return float("nan")
    jsd = torch.tensor([jsd_bits(w_base_EE[i] / out_b[i], w_post_EE[i] / out_p[i]) for i in rows], dtype=torch.float64)
    return float((weights / weights.sum() * jsd).sum())


# --------------------------------------------------------------------------- step level


def step_ids(input_ids: list[int], span_ids: list[int], decode, pattern: str) -> list[int]:
    """Per token, its answer step (-1 outside answers): steps are numbered through the row, a new answer
    span starts a new step, and a step ends with the token in which a match of ``pattern`` ends.
    ``decode(id) -> str`` gives a token's text."""
    regex = re.compile(pattern)
    out = [-1] * len(input_ids)
    step, t = -1, 0
    while t < len(input_ids):
        if span_ids[t] != SPAN_A:
            t += 1
            continue
        run = range(t, next((u for u in range(t, len(input_ids)) if span_ids[u] != SPAN_A), len(input_ids)))
        pieces = [decode(input_ids[u]) for u in run]
        ends, pos = [], 0
        for piece in pieces:
            pos += len(piece)
            ends.append(pos)
        cuts = {m.end() for m in regex.finditer("".join(pieces)) if m.end() > 0}
        step += 1
        for i, u in enumerate(run):
            out[u] = step
            start = ends[i] - len(pieces[i])
            if any(start < c <= ends[i] for c in cuts) and i + 1 < len(run):
                step += 1
        t = run.stop
    return out


class StepTransitionAccumulator:
    """Per layer: Σ over consecutive steps of one answer of u_j u_{j+1}ᵀ, and the number of such pairs."""

    def __init__(self, num_layers: int, num_experts: int) -> None:
        self.num_experts = num_experts
        self.counts_LEE = torch.zeros(num_layers, num_experts, num_experts, dtype=torch.float64)
        self.steps_L = torch.zeros(num_layers, dtype=torch.int64)

    def add(self, pos: int, ids_BTK: torch.Tensor, step_BT: torch.Tensor, span_BT: torch.Tensor) -> None:
        E = self.num_experts
        for b in range(ids_BTK.shape[0]):
            steps_T = step_BT[b]
            keep = steps_T >= 0
            if not keep.any():
                continue
            first, last = int(steps_T[keep].min()), int(steps_T[keep].max())
            J = last - first + 1
            onehot_TE = torch.zeros(int(keep.sum()), E, dtype=torch.float64)
            onehot_TE.scatter_(1, ids_BTK[b][keep].long(), 1.0)
            u_JE = torch.zeros(J, E, dtype=torch.float64).index_add_(0, steps_T[keep] - first, onehot_TE)
            u_JE = u_JE / u_JE.sum(1, keepdim=True).clamp(min=1)
            # consecutive steps of one answer: the step after j starts right where j ends, inside an answer
            span_T = span_BT[b]
            positions = torch.nonzero(keep).flatten()
            boundary = [
                (int(steps_T[positions[i]]) - first, int(steps_T[positions[i + 1]]) - first)
                for i in range(len(positions) - 1)
                if steps_T[positions[i + 1]] == steps_T[positions[i]] + 1
                and positions[i + 1] == positions[i] + 1
                and span_T[positions[i + 1]] == SPAN_A
            ]
            for j, k in boundary:
                self.counts_LEE[pos] += torch.outer(u_JE[j], u_JE[k])
                self.steps_L[pos] += 1

    def graph(self, pos: int) -> torch.Tensor:
        steps = int(self.steps_L[pos])
        if steps <= 0:
            raise ValueError("empty selection: no consecutive answer steps to count transitions over")
        return self.counts_LEE[pos] / steps
