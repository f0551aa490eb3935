"""The shuffled-prior controls: base co-activation (or transition) communities and per-layer permutations.

within-soft / within-hard move the prior by one seeded permutation per MoE layer that maps
every expert to an expert of the same base community; global-hard by one seeded
permutation per layer over all experts: pi'[x, s, l, sigma_l(e)] = pi[x, s, l, e].
Communities come from seeded Louvain on the base model's co-activation graph (eq. 1) over
the training data, using the same library functions as the retention diagnostics; the
within-transition controls use the base's directed transition graph of answer tokens instead.

Shape legend: E experts, L MoE layers (positions in the model's list of MoE layers),
N samples, S spans.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from rpb.adapters import MoELayer
from rpb.data import Example, collate
from rpb.observe.trace import RouterTap, route_batch, trace_topk
from rpb.retention.communities import CoactivationAccumulator, louvain
from rpb.retention.transitions import TransitionAccumulator

#: "within-transition" permutes inside the base's transition communities, exactly as "within" does
#: inside its co-activation communities
PERMUTATION_MODES = ("within", "within-transition", "global")

#: Layer l of a run with seed s draws its permutation from a generator seeded with
#: ``s * LAYER_SEED_STRIDE + l``. Injective while l < stride, so no two (seed, layer) pairs share a stream.
LAYER_SEED_STRIDE = 1_000_000


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


def base_transition_communities(
    model: torch.nn.Module,
    layers: list[MoELayer],
    examples: list[Example],
    seed: int,
    resolution: float = 1.0,
    batch_size: int = 8,
    pad_id: int = 0,
) -> BaseCommunities:
    """Seeded directed-Louvain communities of the model's expert-transition graph over ``examples``
    (``rpb.retention.transitions``: consecutive answer tokens), per MoE layer: what the
    within-transition controls shuffle within."""
    num_experts = layers[0].router.weight.shape[0]
    acc = TransitionAccumulator(len(layers), num_experts)
    was_training, tokens = model.training, 0
    model.eval()
    try:
        with RouterTap(layers) as tap:
            for start in range(0, len(examples), batch_size):
                b = collate(examples[start : start + batch_size], pad_id)
                route_batch(model, b)
                rows = b["input_ids"].shape[0]
                for pos in range(len(layers)):
                    ids = tap.topk_ids[pos].cpu()
                    acc.add(pos, ids.view(rows, -1, ids.shape[-1]), b["attention_mask"], b["span_ids"])
                tokens += int(b["attention_mask"].sum())
    finally:
        model.train(was_training)
    found = [louvain(acc.graph(pos), seed=seed, resolution=resolution, directed=True) for pos in range(len(layers))]
    return BaseCommunities(torch.stack([lab for lab, _ in found]), [q for _, q in found], tokens)


def within_community_permutation(labels_E: torch.Tensor, seed: int) -> torch.Tensor:
    """sigma_E with labels[sigma[e]] == labels[e]: a uniform random permutation inside each community.

    Communities are visited in ascending label order, each drawing one ``randperm`` from a
    generator seeded with ``seed``, so the result depends only on (labels, seed). Singleton
    communities are fixed points.
    """
    generator = torch.Generator().manual_seed(seed)
    labels_E = labels_E.cpu()
    sigma_E = torch.arange(labels_E.shape[0], dtype=torch.int64)
    for label in torch.unique(labels_E).tolist():
        members = torch.nonzero(labels_E == label).flatten()
        sigma_E[members] = members[torch.randperm(members.numel(), generator=generator)]
    return sigma_E


def global_permutation(num_experts: int, seed: int) -> torch.Tensor:
    """sigma_E: a uniform random permutation of all experts, ignoring communities."""
    return torch.randperm(num_experts, generator=torch.Generator().manual_seed(seed))


def layer_seed(seed: int, layer_pos: int) -> int:
    """Seed of layer ``layer_pos``'s permutation: ``seed * LAYER_SEED_STRIDE + layer_pos``."""
    if seed < 0 or not 0 <= layer_pos < LAYER_SEED_STRIDE:
        raise ValueError(f"need seed >= 0 and 0 <= layer_pos < {LAYER_SEED_STRIDE}, got {seed}, {layer_pos}")
    return seed * LAYER_SEED_STRIDE + layer_pos


def layer_permutations(
    labels_LE: torch.Tensor | None, num_experts: int, seed: int, mode: str, num_layers: int | None = None
) -> torch.Tensor:
    """One permutation per MoE layer: ``sigma_LE``.

    Layer l uses ``layer_seed(seed, l) = seed * 1_000_000 + l``, so logging ``seed`` and ``mode``
    (plus the base labels for "within") is enough to rebuild every sigma_l. "within" keeps each
    expert inside its base community (needs ``labels_LE``); "global" permutes all experts and only
    reads the layer count, from ``labels_LE`` or ``num_layers``.
    """
    if mode not in PERMUTATION_MODES:
        raise ValueError(f"unknown permutation mode {mode!r}; choose one of {PERMUTATION_MODES}")
    if labels_LE is not None:
        if labels_LE.dim() != 2 or labels_LE.shape[1] != num_experts:
            raise ValueError(f"labels must be [L, {num_experts}], got shape {tuple(labels_LE.shape)}")
        if num_layers is not None and num_layers != labels_LE.shape[0]:
            raise ValueError(f"num_layers={num_layers} disagrees with labels for {labels_LE.shape[0]} layers")
        num_layers = labels_LE.shape[0]
    if mode in ("within", "within-transition"):
        if labels_LE is None:
            raise ValueError(f"mode {mode!r} needs the base community labels (labels_LE)")
        rows = [within_community_permutation(labels_LE[pos], layer_seed(seed, pos)) for pos in range(num_layers)]
    else:
        if num_layers is None:
            raise ValueError("mode 'global' needs labels_LE or num_layers to know how many layers to draw")
        rows = [global_permutation(num_experts, layer_seed(seed, pos)) for pos in range(num_layers)]
    return torch.stack(rows) if rows else torch.empty(0, num_experts, dtype=torch.int64)


def shuffle_prior(pi_NSLE: torch.Tensor, sigma_LE: torch.Tensor) -> torch.Tensor:
    """pi'[..., l, sigma_l(e)] = pi[..., l, e]: expert e's prior mass moves to expert sigma_l(e).

    Shape and dtype are kept, and so is every row's total, because each sigma_l is checked to
    be a bijection (a repeated target would silently drop mass). Any leading dims are allowed.
    """
    if pi_NSLE.shape[-2:] != sigma_LE.shape:
        raise ValueError(f"sigma must be [L, E] = {tuple(pi_NSLE.shape[-2:])}, got shape {tuple(sigma_LE.shape)}")
    sigma_LE = sigma_LE.to(pi_NSLE.device, torch.int64)
    arange_LE = torch.arange(sigma_LE.shape[1], device=sigma_LE.device).expand_as(sigma_LE)
    if not torch.equal(sigma_LE.sort(dim=1).values, arange_LE):
        raise ValueError("every row of sigma must be a permutation of 0..E-1")
    return torch.empty_like(pi_NSLE).scatter_(-1, sigma_LE.expand_as(pi_NSLE), pi_NSLE)
