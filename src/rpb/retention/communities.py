"""Expert co-activation communities (paper eq. 1).

Shape legend for the suffixes on tensor names:
  T = tokens, K = top-k slots, E = routed experts, L = MoE layers (positions 0..L-1 in the
  model's list of MoE layers, not transformer block indices).

Pipeline: top-k indices -> co-activation counts (accumulated per layer over any number of
tokens) -> eq. 1 weights -> Louvain labels per layer -> NMI between base and post-training
labels. The shuffled-prior controls (``rpb.anchors.controls``) reuse the base labels.

Nothing here knows about models, files or tokenizers. Community detection and NMI are the
library implementations (networkx, scikit-learn); this file only adapts tensors to them.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    import networkx as nx

# networkx and scikit-learn (with scipy and pandas behind it) are imported where a graph is built or
# scored, not here: every `rpb train` reaches this module through the shuffled controls, and their
# import cost a second of start-up in each process that never builds a graph.

# --------------------------------------------------------------------------- co-activation


def coactivation_counts(indices_TK: torch.Tensor, num_experts: int, mask_T: torch.Tensor | None = None) -> torch.Tensor:
    """C[i, j] = number of kept tokens whose top-k set holds both i and j; C[i, i] = tokens that chose i.

    ``counts_EE`` is float64 on the device of ``indices_TK``: float64 stays exact up to 2^53, so
    counts accumulated over a whole corpus never round. Tokens with ``mask_T`` False are dropped
    *before* their indices are read, so padding rows may hold any value (e.g. -1). The token
    count that goes with these counts is ``mask_T.sum()`` (or T without a mask).
    """
    if indices_TK.dim() != 2:
        raise ValueError(f"indices must be [T, K], got shape {tuple(indices_TK.shape)}")
    if mask_T is not None:
        if mask_T.shape != indices_TK.shape[:1]:
            raise ValueError(f"mask must be [T] = {indices_TK.shape[0]}, got shape {tuple(mask_T.shape)}")
        indices_TK = indices_TK[mask_T.bool()]
    indices_TK = indices_TK.long()
    if indices_TK.numel() and (indices_TK.min() < 0 or indices_TK.max() >= num_experts):
        raise ValueError(f"expert indices must lie in [0, {num_experts}), got [{indices_TK.min()}, {indices_TK.max()}]")
    # scatter of ones gives set semantics: a repeated index in one row still counts that expert once.
    onehot_TE = torch.zeros(indices_TK.shape[0], num_experts, dtype=torch.float64, device=indices_TK.device)
    onehot_TE.scatter_(1, indices_TK, 1.0)
    return onehot_TE.T @ onehot_TE


def coactivation_graph(counts_EE: torch.Tensor, num_tokens: int | torch.Tensor) -> torch.Tensor:
    """Eq. 1: w_ij = C_ij / N for i != j, zero diagonal (float64)."""
    num_tokens = int(num_tokens)
    if num_tokens <= 0:
        raise ValueError(f"empty selection: eq. 1 needs at least one token, got N = {num_tokens}")
    weights_EE = counts_EE.to(torch.float64) / num_tokens
    weights_EE.fill_diagonal_(0.0)
    return weights_EE


class CoactivationAccumulator:
    """Running per-layer co-activation counts: O(L * E^2) memory, whatever the number of tokens.

    Counts live on the CPU in float64 so that shards collected on different devices or ranks
    can be merged exactly with ``merge``.
    """

    def __init__(self, num_layers: int, num_experts: int) -> None:
        self.num_layers = num_layers
        self.num_experts = num_experts
        self.counts_LEE = torch.zeros(num_layers, num_experts, num_experts, dtype=torch.float64)
        self.tokens_L = torch.zeros(num_layers, dtype=torch.int64)

    def add(self, layer_pos: int, indices_TK: torch.Tensor, mask_T: torch.Tensor | None = None) -> None:
        counts_EE = coactivation_counts(indices_TK, self.num_experts, mask_T)
        self.counts_LEE[layer_pos] += counts_EE.cpu()
        self.tokens_L[layer_pos] += indices_TK.shape[0] if mask_T is None else int(mask_T.bool().sum())

    def merge(self, other: CoactivationAccumulator) -> CoactivationAccumulator:
        """Add another accumulator's counts (another shard or rank) into this one; returns self."""
        if other.counts_LEE.shape != self.counts_LEE.shape:
            raise ValueError(
                f"cannot merge counts of shape {tuple(other.counts_LEE.shape)} "
                f"into counts of shape {tuple(self.counts_LEE.shape)}"
            )
        self.counts_LEE += other.counts_LEE
        self.tokens_L += other.tokens_L
        return self

    def graph(self, layer_pos: int) -> torch.Tensor:
        """Eq. 1 weights of one layer; raises ValueError ("empty selection") if it saw no token."""
        return coactivation_graph(self.counts_LEE[layer_pos], self.tokens_L[layer_pos])


# --------------------------------------------------------------------------- communities


def expert_graph(weights_EE: torch.Tensor) -> nx.Graph:
    """Undirected weighted networkx graph with every expert as a node, isolated ones included.

    Nodes and edges are inserted in ascending id order because networkx's Louvain result
    depends on iteration order as well as on the seed. The diagonal is ignored (eq. 1 has i != j).
    """
    if weights_EE.dim() != 2 or weights_EE.shape[0] != weights_EE.shape[1]:
        raise ValueError(f"weights must be a square [E, E] matrix, got shape {tuple(weights_EE.shape)}")
    w = weights_EE.detach().to("cpu", torch.float64)
    if not torch.allclose(w, w.T):
        raise ValueError("co-activation weights must be symmetric")
    if (w < 0).any():
        raise ValueError("co-activation weights must be non-negative")
    num_experts = w.shape[0]
    import networkx as nx

    graph = nx.Graph()
    graph.add_nodes_from(range(num_experts))
    rows, cols = torch.triu_indices(num_experts, num_experts, offset=1)
    for i, j, weight in zip(rows.tolist(), cols.tolist(), w[rows, cols].tolist(), strict=True):
        if weight > 0:
            graph.add_edge(i, j, weight=weight)
    return graph


def directed_graph(weights_EE: torch.Tensor) -> nx.DiGraph:
    """Directed weighted networkx graph, every expert a node, self-loops kept, edges in id order
    (the expert-transition graph of ``rpb.retention.transitions``)."""
    if weights_EE.dim() != 2 or weights_EE.shape[0] != weights_EE.shape[1]:
        raise ValueError(f"weights must be a square [E, E] matrix, got shape {tuple(weights_EE.shape)}")
    w = weights_EE.detach().to("cpu", torch.float64)
    if (w < 0).any():
        raise ValueError("transition weights must be non-negative")
    import networkx as nx

    graph = nx.DiGraph()
    graph.add_nodes_from(range(w.shape[0]))
    rows, cols = torch.nonzero(w > 0, as_tuple=True)
    graph.add_weighted_edges_from(zip(rows.tolist(), cols.tolist(), w[rows, cols].tolist(), strict=True))
    return graph


def louvain(
    weights_EE: torch.Tensor, seed: int, resolution: float = 1.0, directed: bool = False
) -> tuple[torch.Tensor, float]:
    """Louvain communities of one layer's graph: ``(labels_E, modularity)``.

    ``directed=False``: the eq. 1 co-activation graph (``expert_graph``: symmetric weights, diagonal
    ignored); ``directed=True``: a transition graph (``directed_graph``: diagonal kept, nothing
    symmetrised), under directed modularity. Labels are renumbered 0..C-1 in order of each community's
    smallest expert id, so equal partitions always give equal label vectors. Isolated experts form
    singleton communities. The modularity is the textbook weighted Q (resolution 1) of the returned
    partition, so values stay comparable across ``resolution`` settings; it is NaN for a graph without
    edges (e.g. K = 1), where modularity is undefined.
    """
    from networkx.algorithms.community import louvain_communities, modularity

    graph = directed_graph(weights_EE) if directed else expert_graph(weights_EE)
    # backend="networkx" pins the reference implementation even where a GPU backend is installed.
    communities = louvain_communities(graph, weight="weight", resolution=resolution, seed=seed, backend="networkx")
    communities = sorted(communities, key=min)
    labels_E = torch.empty(graph.number_of_nodes(), dtype=torch.int64)
    for label, members in enumerate(communities):
        labels_E[sorted(members)] = label
    if graph.number_of_edges() == 0:
        return labels_E, float("nan")
    return labels_E, float(modularity(graph, communities, weight="weight"))


def nmi(labels_a_E: torch.Tensor, labels_b_E: torch.Tensor) -> float:
    """Normalized mutual information of two labelings of the same experts.

    scikit-learn's ``normalized_mutual_info_score`` with its default arithmetic averaging:
    NMI = I(A; B) / ((H(A) + H(B)) / 2), natural log. Label names do not matter; two labelings
    that each put all experts in one community score 1.0 (scikit-learn's convention).
    """
    if labels_a_E.shape != labels_b_E.shape or labels_a_E.dim() != 1:
        raise ValueError(f"need two [E] labelings, got {tuple(labels_a_E.shape)} and {tuple(labels_b_E.shape)}")
    from sklearn.metrics import normalized_mutual_info_score

    return float(normalized_mutual_info_score(labels_a_E.cpu().numpy(), labels_b_E.cpu().numpy()))
