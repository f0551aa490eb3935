"""Eq. 1 co-activation graphs and Louvain/NMI against hand-worked values."""

import itertools
import math

import pytest
import torch

from rpb.retention.communities import (
    CoactivationAccumulator,
    coactivation_counts,
    coactivation_graph,
    louvain,
    nmi,
)

# Four tokens over four experts (K = 2): expert pairs {0,1}, {0,1}, {2,3}, {1,2}.
HAND_TRACE_TK = torch.tensor([[0, 1], [1, 0], [2, 3], [1, 2]])
# Eq. 1 with N = 4: w01 = 2/4, w23 = 1/4, w12 = 1/4, zero diagonal.
HAND_GRAPH_EE = torch.tensor(
    [
        [0.0, 0.5, 0.0, 0.0],
        [0.5, 0.0, 0.25, 0.0],
        [0.0, 0.25, 0.0, 0.25],
        [0.0, 0.0, 0.25, 0.0],
    ],
    dtype=torch.float64,
)


# --------------------------------------------------------------------------- co-activation


def test_counts_match_a_plain_double_loop_with_mask():
    gen = torch.Generator().manual_seed(3)
    num_tokens, top_k, num_experts = 60, 3, 8
    indices_TK = torch.stack([torch.randperm(num_experts, generator=gen)[:top_k] for _ in range(num_tokens)])
    mask_T = torch.rand(num_tokens, generator=gen) < 0.6
    indices_TK[~mask_T, 0] = -1  # padding rows may hold anything; they must never be read

    expected = [[0] * num_experts for _ in range(num_experts)]
    for row, keep in zip(indices_TK.tolist(), mask_T.tolist(), strict=True):
        if not keep:
            continue
        for i in row:
            for j in row:
                expected[i][j] += 1

    counts_EE = coactivation_counts(indices_TK, num_experts, mask_T)
    assert counts_EE.dtype == torch.float64
    assert counts_EE.tolist() == expected
    # the diagonal is the number of kept tokens that chose each expert
    kept = indices_TK[mask_T].flatten().tolist()
    assert counts_EE.diagonal().tolist() == [kept.count(e) for e in range(num_experts)]


def test_graph_of_a_hand_made_trace():
    counts_EE = coactivation_counts(HAND_TRACE_TK, 4)
    assert counts_EE.diagonal().tolist() == [2, 3, 2, 1]
    assert torch.equal(coactivation_graph(counts_EE, 4), HAND_GRAPH_EE)


def test_accumulator_shards_masks_and_merge_give_the_hand_graph():
    acc = CoactivationAccumulator(num_layers=2, num_experts=4)
    acc.add(1, HAND_TRACE_TK[:2])
    # the masked-out token [3, 0] must not count, in weights nor in N
    acc.add(1, torch.tensor([[2, 3], [3, 0]]), mask_T=torch.tensor([True, False]))
    other = CoactivationAccumulator(num_layers=2, num_experts=4)
    other.add(1, HAND_TRACE_TK[3:])
    other.add(0, torch.tensor([[0, 3]]))
    acc.merge(other)

    assert acc.tokens_L.tolist() == [1, 4]
    assert torch.equal(acc.graph(1), HAND_GRAPH_EE)
    assert acc.graph(0)[0, 3] == 1.0 and acc.graph(0).sum() == 2.0


def test_accumulator_memory_does_not_grow_with_tokens():
    acc = CoactivationAccumulator(num_layers=3, num_experts=16)
    acc.add(2, torch.randint(0, 16, (20_000, 4)))
    assert acc.counts_LEE.shape == (3, 16, 16) and acc.tokens_L.tolist() == [0, 0, 20_000]


def test_empty_selection_raises():
    with pytest.raises(ValueError, match="empty selection"):
        coactivation_graph(torch.zeros(4, 4), 0)
    acc = CoactivationAccumulator(num_layers=1, num_experts=4)
    acc.add(0, HAND_TRACE_TK, mask_T=torch.zeros(4, dtype=torch.bool))
    assert acc.counts_LEE.sum() == 0
    with pytest.raises(ValueError, match="empty selection"):
        acc.graph(0)


def test_out_of_range_expert_is_refused():
    with pytest.raises(ValueError, match="expert indices"):
        coactivation_counts(torch.tensor([[0, 4]]), 4)


# --------------------------------------------------------------------------- communities


def two_cliques_with_isolated_expert():
    """Cliques {0,2,5,7} and {1,4,6,8} (unit weights), a 0.1 bridge 7-8, expert 3 isolated."""
    weights_EE = torch.zeros(9, 9, dtype=torch.float64)
    edges = [(i, j, 1.0) for clique in ([0, 2, 5, 7], [1, 4, 6, 8]) for i, j in itertools.combinations(clique, 2)]
    edges.append((7, 8, 0.1))
    for i, j, w in edges:
        weights_EE[i, j] = weights_EE[j, i] = w
    return weights_EE, edges


def textbook_modularity(edges, communities):
    """Q = sum_c [L_c / m - (d_c / 2m)^2] with weighted internal edges L_c and degree sums d_c."""
    m = sum(w for _, _, w in edges)
    q = 0.0
    for members in communities:
        internal = sum(w for i, j, w in edges if i in members and j in members)
        degree = sum(w * ((i in members) + (j in members)) for i, j, w in edges)
        q += internal / m - (degree / (2 * m)) ** 2
    return q


@pytest.mark.parametrize("seed", [0, 1, 7])
def test_louvain_finds_two_cliques_with_canonical_labels(seed):
    weights_EE, edges = two_cliques_with_isolated_expert()
    labels_E, q = louvain(weights_EE, seed=seed)
    # communities numbered by their smallest expert: {0,..} -> 0, {1,..} -> 1, {3} -> 2
    assert labels_E.tolist() == [0, 1, 0, 2, 1, 0, 1, 0, 1]
    expected_q = textbook_modularity(edges, [{0, 2, 5, 7}, {1, 4, 6, 8}, {3}])
    assert expected_q == pytest.approx(12 / 12.1 - 0.5)  # each clique: 6/12.1 - (12.1/24.2)^2
    assert q == pytest.approx(expected_q, abs=1e-12)


def test_louvain_on_a_graph_without_edges_gives_singletons():
    labels_E, q = louvain(torch.zeros(3, 3), seed=0)
    assert labels_E.tolist() == [0, 1, 2] and math.isnan(q)


def test_louvain_refuses_an_asymmetric_matrix():
    with pytest.raises(ValueError, match="symmetric"):
        louvain(torch.tensor([[0.0, 1.0], [0.0, 0.0]]), seed=0)


@pytest.mark.parametrize("seed", [0, 3])
def test_directed_louvain_finds_two_one_way_cycles_under_directed_modularity(seed):
    """0 -> 1 -> 2 -> 0 and 3 -> 4 -> 5 -> 3 (weight 1), joined by 2 -> 3 (weight 0.1): nothing symmetrised,
    so the directed graph refuses no asymmetry, and Q is the directed one, by hand:
    sum over communities of internal / m - out_c * in_c / m**2 with m = 6.1."""
    weights_EE = torch.zeros(6, 6, dtype=torch.float64)
    for i, j in [(0, 1), (1, 2), (2, 0), (3, 4), (4, 5), (5, 3)]:
        weights_EE[i, j] = 1.0
    weights_EE[2, 3] = 0.1
    labels_E, q = louvain(weights_EE, seed=seed, directed=True)
    assert labels_E.tolist() == [0, 0, 0, 1, 1, 1]
    m = 6.1
    assert q == pytest.approx(3 / m - 3.1 * 3 / m**2 + 3 / m - 3 * 3.1 / m**2, abs=1e-12)
    with pytest.raises(ValueError, match="symmetric"):
        louvain(weights_EE, seed=seed)  # the co-activation graph of eq. 1 must be symmetric


def test_nmi_identical_and_renamed_labelings_score_one():
    labels = torch.tensor([0, 0, 1, 1, 2])
    assert nmi(labels, labels) == pytest.approx(1.0)
    assert nmi(labels, torch.tensor([5, 5, 3, 3, 9])) == pytest.approx(1.0)


def test_nmi_matches_a_hand_computed_value():
    a, b = torch.tensor([0, 0, 1, 1]), torch.tensor([0, 0, 0, 1])
    # joint: (0,0) 2/4, (1,0) 1/4, (1,1) 1/4; marginals a: 1/2, 1/2; b: 3/4, 1/4
    mutual = 0.5 * math.log(0.5 / (0.5 * 0.75)) + 0.25 * math.log(0.25 / (0.5 * 0.75)) + 0.25 * math.log(0.25 / 0.125)
    h_a = math.log(2)
    h_b = -(0.75 * math.log(0.75) + 0.25 * math.log(0.25))
    assert nmi(a, b) == pytest.approx(mutual / ((h_a + h_b) / 2), abs=1e-12)
