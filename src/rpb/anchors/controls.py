"""The shuffled-prior controls: base co-activation communities and per-layer permutations.

within-soft / within-hard move the prior by one seeded permutation per MoE layer that maps
every expert to an expert of the same base community; global-hard by one seeded
permutation per layer over all experts. Communities come from seeded Louvain on the base
model's co-activation graph (eq. 1) over the training data, using the same library
functions as the retention diagnostics.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from rpb.adapters import MoELayer
from rpb.communities import CoactivationAccumulator, louvain
from rpb.data import Example
from rpb.trace import trace_topk


@dataclass
class BaseCommunities:
    labels_LE: torch.Tensor
    modularity_L: list[float]
    tokens: int


def base_communities(
    model: torch.nn.Module,
    layers: list[MoELayer],
    examples: list[Example],
    seed: int,
    resolution: float = 1.0,
    batch_size: int = 8,
    pad_id: int = 0,
    progress: bool = False,
) -> BaseCommunities:
    """Seeded Louvain communities of the model's co-activation graph over ``examples``, per MoE layer."""
    num_experts = layers[0].router.weight.shape[0]
    acc = CoactivationAccumulator(len(layers), num_experts)

    def consume(pos, topk_ids_TK, logits_TE, valid_T, span_T):
        acc.add(pos, topk_ids_TK, valid_T)

    tokens = trace_topk(model, layers, examples, consume, batch_size, pad_id, progress, desc="base communities")
    labels, mods = [], []
    for pos in range(len(layers)):
        lab, q = louvain(acc.graph(pos), seed=seed, resolution=resolution)
        labels.append(lab)
        mods.append(q)
    return BaseCommunities(torch.stack(labels), mods, tokens)
