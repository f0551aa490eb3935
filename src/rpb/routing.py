"""Pure routing math: expert selection on (possibly biased) logits, gates from unbiased ones.

Shape legend for the suffixes on tensor names:
  T = tokens (the router's flattened batch x positions), E = routed experts,
  K = top-k, G = expert groups.

The bias is an argument and it only chooses experts (as torchtitan's MoE router takes
its ``expert_bias``): ``select`` runs the model's own selection pipeline on
``logits + bias`` -- score function, the frozen expert-correction bias, group-limited
top-k, top-k -- and ``combine_weights`` computes the gates exactly as the model does,
from the *unbiased* logits at the chosen experts -- score function, renormalisation,
scaling; the expert-correction bias never enters a gate. The operations mirror the
transformers routers one for one (same ops, same order, same ``sorted`` flag), so on
an all-zero bias they return bit-identical indices and gates.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class RouterSpec:
    """One router's selection pipeline (``rpb.adapters.router_spec`` reads it off a model's router)."""

    score_function: str
    top_k: int
    num_experts: int
    group_scoring: str | None = None
    num_groups: int = 1
    topk_groups: int = 1
    normalize: bool = False
    normalize_eps: float = 0.0
    scaling: float = 1.0
    topk_sorted: bool = True
    weights_in_logits_dtype: bool = False


#: the score functions a router may apply: "softmax" / "sigmoid" over all experts, both in float32;
#: "topk-softmax" (gpt-oss) selects on the logits themselves and takes the softmax of the chosen ones
SCORE_FUNCTIONS = ("softmax", "sigmoid", "topk-softmax")


def scores(logits_TE: torch.Tensor, score_function: str) -> torch.Tensor:
    """What the router ranks the experts by: its score function in float32, or (``topk-softmax``) the
    logits as they are."""
    if score_function == "sigmoid":
        return logits_TE.float().sigmoid()
    if score_function == "topk-softmax":
        return logits_TE
    return torch.softmax(logits_TE, dim=-1, dtype=torch.float32)


def kept_groups(choice_TE: torch.Tensor, spec: RouterSpec) -> torch.Tensor:
    """``kept_TG``: True for the groups group-limited routing keeps, from the selection scores."""
    per_group = spec.num_experts // spec.num_groups
    grouped_TGe = choice_TE.view(-1, spec.num_groups, per_group)
    if spec.group_scoring == "top2-sum":
        group_scores_TG = grouped_TGe.topk(2, dim=-1)[0].sum(dim=-1)
    else:  # "max"
        group_scores_TG = grouped_TGe.max(dim=-1).values
    group_idx = torch.topk(group_scores_TG, k=spec.topk_groups, dim=-1, sorted=False)[1]
    return torch.zeros_like(group_scores_TG).scatter_(1, group_idx, 1).bool()


def select_with_groups(
    logits_TE: torch.Tensor,
    spec: RouterSpec,
    bias_TE: torch.Tensor | None = None,
    expert_bias_E: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """``(topk_ids_TK, kept_TG)``: the selection and, for group-limited routers, the groups it kept."""
    z_TE = logits_TE if bias_TE is None else logits_TE + bias_TE
    choice_TE = scores(z_TE, spec.score_function)
    if expert_bias_E is not None:
        choice_TE = choice_TE + expert_bias_E
    kept_TG = None
    if spec.group_scoring is not None:
        kept_TG = kept_groups(choice_TE, spec)
        per_group = spec.num_experts // spec.num_groups
        keep_TE = kept_TG.unsqueeze(-1).expand(-1, spec.num_groups, per_group).reshape(-1, spec.num_experts)
        # DeepSeek-V3 masks losing groups to -inf; DeepSeek-V2 zeroes their (softmax) scores
        fill = float("-inf") if spec.group_scoring == "top2-sum" else 0.0
        choice_TE = choice_TE.masked_fill(~keep_TE, fill)
    return torch.topk(choice_TE, k=spec.top_k, dim=-1, sorted=spec.topk_sorted)[1], kept_TG


def select(
    logits_TE: torch.Tensor,
    spec: RouterSpec,
    bias_TE: torch.Tensor | None = None,
    expert_bias_E: torch.Tensor | None = None,
) -> torch.Tensor:
    """``topk_ids_TK``: the model's own selection on ``logits + bias`` (bias: selection only)."""
    return select_with_groups(logits_TE, spec, bias_TE, expert_bias_E)[0]


def combine_weights(logits_TE: torch.Tensor, topk_ids_TK: torch.Tensor, spec: RouterSpec) -> torch.Tensor:
    """``gates_TK``: the model's gates for the chosen experts, from the unbiased logits."""
    if spec.score_function == "topk-softmax":  # gpt-oss: the softmax of the chosen logits, in their dtype
        return torch.softmax(logits_TE.gather(1, topk_ids_TK), dim=1, dtype=logits_TE.dtype)
    gates_TK = scores(logits_TE, spec.score_function).gather(1, topk_ids_TK)
    if spec.normalize:
        denominator = gates_TK.sum(dim=-1, keepdim=True)
        if spec.normalize_eps:
            denominator = denominator + spec.normalize_eps
        gates_TK = gates_TK / denominator
    if spec.scaling != 1.0:
        gates_TK = gates_TK * spec.scaling
    if spec.weights_in_logits_dtype:
        gates_TK = gates_TK.to(logits_TE.dtype)
    return gates_TK


def route(
    logits_TE: torch.Tensor,
    spec: RouterSpec,
    bias_TE: torch.Tensor | None = None,
    expert_bias_E: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(gates_TK, topk_ids_TK)``: selection on biased logits, gates from unbiased ones."""
    topk_ids_TK = select(logits_TE, spec, bias_TE, expert_bias_E)
    return combine_weights(logits_TE, topk_ids_TK, spec), topk_ids_TK


def select_from_prior(prior_TE: torch.Tensor, top_k: int) -> torch.Tensor:
    """``topk_ids_TK`` of the prior alone (the hard controls: the prior forces the top-k)."""
    return torch.topk(prior_TE, k=top_k, dim=-1, sorted=False)[1]
