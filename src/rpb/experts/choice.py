"""Which experts a task routes to, and the ESFT-style choice of experts to train (pure; no model here).

Shape legend: N = samples, S = spans (0 = question, 1 = answer), L = MoE layers, E = routed experts.

ESFT's two relevance measures, both per sample first and then averaged over the samples with tokens:

* ``gate``: the average gate score, mean over a sample's tokens of the router's probabilities (the prior's
  per-(sample, span) means, weighted by the tokens behind each span when both spans count);
* ``token``: the token-selection ratio, the share of a sample's top-k selections that go to each expert
  (``selection_ratio`` from one pass of the base over the data).

Per layer the scores are normalised to sum 1; ``choose`` takes the highest until their cumulative share
reaches ``threshold`` (ESFT's top-p), or the ``top_n`` highest. Ties go to the lower expert id.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import torch

from rpb.errors import ArgumentError

SPANS = {"question": (0,), "answer": (1,), "all": (0, 1)}


def gate_scores(prior_NSLE: torch.Tensor, span_tokens_NS: torch.Tensor, span: str = "all") -> torch.Tensor:
    """``[L, E]``: the average gate score of each expert over the samples (``span``: which tokens count)."""
    s = list(SPANS[span])
    weights_NS = span_tokens_NS[:, s].double()
    tokens_N = weights_NS.sum(-1)
    per_sample_NLE = (prior_NSLE[:, s].double() * weights_NS[:, :, None, None]).sum(1)
    seen = tokens_N > 0
    return (per_sample_NLE[seen] / tokens_N[seen, None, None]).mean(0)


def selection_ratio(counts_NLE: torch.Tensor, tokens_N: torch.Tensor, top_k: int) -> torch.Tensor:
    """``[L, E]``: each sample's selections per expert over its ``tokens x top_k``, averaged over the samples
    with tokens."""
    seen = tokens_N > 0
    return (counts_NLE[seen].double() / (tokens_N[seen, None, None].double() * top_k)).mean(0)


def choose(scores_LE: torch.Tensor, threshold: float | None = None, top_n: int | None = None) -> list[list[int]]:
    """Each layer's chosen expert ids, highest score first."""
    if (threshold is None) == (top_n is None):
        raise ArgumentError("choose experts by exactly one of a cumulative threshold or a top-n per layer")
    E = scores_LE.shape[1]
    if threshold is not None and not 0 < threshold <= 1:
        raise ArgumentError(f"threshold: a cumulative share in (0, 1], got {threshold}")
    if top_n is not None and not 1 <= top_n <= E:
        raise ArgumentError(f"top-n: between 1 and the {E} experts, got {top_n}")
    out = []
    for row in scores_LE.double():
        share = row / row.sum()
        order = sorted(range(E), key=lambda e: (-float(share[e]), e))
        if top_n is not None:
            out.append(order[:top_n])
            continue
        chosen, total = [], 0.0
        for e in order:
            chosen.append(e)
            total += float(share[e])
            if total >= threshold - 1e-12:
                break
        out.append(chosen)
    return out


def never_selected(chosen: list[list[int]], shares_LE: torch.Tensor, layers: list[int]) -> dict[int, list[int]]:
    """The chosen experts whose token-selection share is 0, per decoder layer (``layers``: the rows' indices);
    layers with none left out."""
    out = {}
    for layer, ids, row in zip(layers, chosen, shares_LE, strict=True):
        zero = [e for e in ids if float(row[e]) == 0.0]
        if zero:
            out[layer] = zero
    return out


@dataclass
class ExpertChoice:
    """The experts to train per MoE layer (decoder layer index -> expert ids), in ESFT's file format."""

    experts: dict[int, list[int]]
    shared_experts: bool = False
    non_expert_modules: bool = False
    #: how the choice was made (measure, threshold, scores, the prior it came from); not read back
    provenance: dict | None = None

    def to_json(self) -> str:
        body = {
            "experts": {str(k): v for k, v in sorted(self.experts.items())},
            "shared_experts": self.shared_experts,
            "non_expert_modules": self.non_expert_modules,
        }
        if self.provenance is not None:
            body["rpb"] = self.provenance
        return json.dumps(body, indent=1)

    def mask(self, layer_index: int, num_experts: int) -> torch.Tensor:
        """``[E]`` bool: the experts of this decoder layer to train."""
        keep = torch.zeros(num_experts, dtype=torch.bool)
        keep[self.experts.get(layer_index, [])] = True
        return keep


def read_choice(path: str | Path) -> ExpertChoice:
    """An ESFT-style expert config (``rpb experts`` writes one); every problem named with the file."""
    try:
        body = json.loads(Path(path).read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise ArgumentError(f"{path}: not a readable JSON expert config ({e})") from None
    problems = []
    if not isinstance(body, dict):
        raise ArgumentError(f"{path}: expected a JSON object with experts, shared_experts, non_expert_modules")
    experts = body.get("experts")
    if not isinstance(experts, dict):
        problems.append("experts: expected an object of layer index -> list of expert ids")
        experts = {}
    parsed = {}
    for key, ids in experts.items():
        if not (isinstance(key, str) and key.isdigit()):
            problems.append(f"experts: key {key!r} is not a decoder layer index")
        elif not (isinstance(ids, list) and all(type(i) is int and i >= 0 for i in ids)):
            problems.append(f"experts.{key}: expected a list of expert ids (integers >= 0), got {ids!r}")
        else:
            parsed[int(key)] = list(ids)
    for flag in ("shared_experts", "non_expert_modules"):
        if not isinstance(body.get(flag, False), bool):
            problems.append(f"{flag}: expected true or false, got {body[flag]!r}")
    if problems:
        raise ArgumentError(f"{path}: invalid expert config:\n  " + "\n  ".join(problems))
    return ExpertChoice(parsed, body.get("shared_experts", False), body.get("non_expert_modules", False))
