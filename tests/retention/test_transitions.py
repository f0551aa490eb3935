"""Transition graphs against hand-built counts and a synthetic routing whose structure is sequential."""

from __future__ import annotations

import networkx as nx
import pytest
import torch

from rpb.prior import SPAN_A, SPAN_Q, STRUCTURAL
from rpb.retention.communities import coactivation_counts, coactivation_graph, directed_graph, louvain
from rpb.retention.transitions import (
    TransitionAccumulator,
    self_share,
    transition_counts,
    transition_row_jsd,
    transition_tvd,
)

A, Q, S = SPAN_A, SPAN_Q, STRUCTURAL


def test_three_tokens_give_the_hand_counted_w():
    ids = torch.tensor([[[0, 1], [1, 2], [3, 0]]])
    counts, steps = transition_counts(ids, torch.ones(1, 3), torch.full((1, 3), A), 4)
    expected = torch.zeros(4, 4, dtype=torch.float64)
    for e, f in [(0, 1), (0, 2), (1, 1), (1, 2), (1, 3), (1, 0), (2, 3), (2, 0)]:
        expected[e, f] += 1
    assert steps == 2 and torch.equal(counts, expected)
    assert self_share(counts / steps) == pytest.approx(1 / 8)  # expert 1 stays once in 8 pairs


def test_nothing_crosses_spans_rows_or_padding():
    ids = torch.tensor([[[0, 1], [1, 2], [2, 3], [3, 0]], [[0, 1], [1, 2], [2, 3], [3, 0]]])
    span = torch.tensor([[A, A, Q, A], [A, S, A, A]])
    valid = torch.tensor([[1, 1, 1, 1], [1, 1, 1, 0]])
    counts, steps = transition_counts(ids, valid, span, 4)
    # row 0: only tokens 0 -> 1 (token 2 is a question token); row 1: token 2 -> 3 is padding
    expected, _ = transition_counts(ids[:1, :2], torch.ones(1, 2), torch.full((1, 2), A), 4)
    assert steps == 1 and torch.equal(counts, expected)


def _synthetic(rows: int = 40, length: int = 12, seed: int = 0):
    """Groups X={0,1}, Y={2,3}, Z={4,5}, W={6,7}; every token selects one whole group; a row alternates
    X and Y, or Z and W, starting anywhere."""
    gen = torch.Generator().manual_seed(seed)
    groups = torch.tensor([[0, 1], [2, 3], [4, 5], [6, 7]])
    ids = torch.empty(rows, length, 2, dtype=torch.long)
    for r in range(rows):
        pair = (0, 1) if r % 2 == 0 else (2, 3)
        start = int(torch.randint(2, (1,), generator=gen))
        for t in range(length):
            ids[r, t] = groups[pair[(start + t) % 2]]
    return ids, torch.ones(rows, length), torch.full((rows, length), A)


def test_sequential_structure_is_found_by_transitions_and_missed_by_coactivation():
    ids, valid, span = _synthetic()
    acc = TransitionAccumulator(1, 8)
    acc.add(0, ids, valid, span)
    labels, q = louvain(acc.graph(0), seed=0, directed=True)
    partition = {frozenset(torch.nonzero(labels == c).flatten().tolist()) for c in labels.unique().tolist()}
    assert partition == {frozenset({0, 1, 2, 3}), frozenset({4, 5, 6, 7})} and q > 0
    static, _ = louvain(
        coactivation_graph(coactivation_counts(ids.reshape(-1, 2), 8), ids.shape[0] * ids.shape[1]), seed=0
    )
    static_partition = {frozenset(torch.nonzero(static == c).flatten().tolist()) for c in static.unique().tolist()}
    assert static_partition == {frozenset({0, 1}), frozenset({2, 3}), frozenset({4, 5}), frozenset({6, 7})}


def test_streaming_equals_one_pass():
    ids, valid, span = _synthetic(rows=24, seed=3)
    span[::3, 5] = Q  # some breaks
    whole = TransitionAccumulator(2, 8)
    whole.add(1, ids, valid, span)
    parts = TransitionAccumulator(2, 8)
    for start in range(0, 24, 5):
        parts.add(1, ids[start : start + 5], valid[start : start + 5], span[start : start + 5])
    assert torch.equal(parts.counts_LEE, whole.counts_LEE) and torch.equal(parts.steps_L, whole.steps_L)


def test_direction_is_kept():
    """A one-way chain 0 -> 1 -> 2 -> 3: the graph keeps the direction; its reverse is another graph."""
    ids = torch.tensor([[[0], [1], [2], [3]]] * 5)
    acc = TransitionAccumulator(1, 4)
    acc.add(0, ids, torch.ones(5, 4), torch.full((5, 4), A))
    w = acc.graph(0)
    g = directed_graph(w)
    assert g.has_edge(0, 1) and not g.has_edge(1, 0) and isinstance(g, nx.DiGraph)
    assert transition_tvd(w, w.T) == pytest.approx(1.0)
    util = torch.ones(4)
    assert transition_row_jsd(w, w, util) == 0
    # directed modularity of a partition differs from the modularity of the symmetrised graph
    parts = [{0, 1}, {2, 3}]
    sym = nx.Graph()
    sym.add_weighted_edges_from((int(i), int(j), float(w[i, j] + w[j, i])) for i, j in torch.nonzero(w + w.T).tolist())
    directed_q = nx.community.modularity(g, parts, weight="weight")
    assert directed_q != pytest.approx(nx.community.modularity(sym, parts, weight="weight"))


def test_row_jsd_weights_rows_by_base_utilization():
    w_b = torch.tensor([[0.0, 1.0], [1.0, 0.0]], dtype=torch.float64)
    w_p = torch.tensor([[0.5, 0.5], [1.0, 0.0]], dtype=torch.float64)
    from scipy.spatial.distance import jensenshannon

    row0 = jensenshannon([0.0, 1.0], [0.5, 0.5], base=2) ** 2
    assert transition_row_jsd(w_b, w_p, torch.tensor([3.0, 1.0])) == pytest.approx(0.75 * row0)


def test_step_ids_cut_after_the_delimiter_token_and_restart_per_answer():
    from rpb.retention.transitions import step_ids

    text = {1: "a", 2: "b\n", 3: "c", 4: "d\n", 5: "e", 9: "<s>"}
    ids = [9, 1, 2, 3, 4, 5, 9, 1, 2, 3]
    span = [S, A, A, A, A, A, S, A, A, A]
    assert step_ids(ids, span, text.__getitem__, r"\n") == [-1, 0, 0, 1, 1, 2, -1, 3, 3, 4]
    # a match that ends the answer does not open an empty step
    assert step_ids([1, 2], [A, A], text.__getitem__, r"\n") == [0, 0]


def test_step_transitions_are_outer_products_of_consecutive_step_usage():
    from rpb.retention.transitions import StepTransitionAccumulator

    ids = torch.tensor([[[0, 1], [0, 2], [3, 1], [3, 1], [2, 0]]])
    steps = torch.tensor([[0, 0, 1, 1, 2]])
    span = torch.full((1, 5), A)
    acc = StepTransitionAccumulator(1, 4)
    acc.add(0, ids, steps, span)
    u0 = torch.tensor([2.0, 1, 1, 0], dtype=torch.float64) / 4
    u1 = torch.tensor([0.0, 2, 0, 2], dtype=torch.float64) / 4
    u2 = torch.tensor([1.0, 0, 1, 0], dtype=torch.float64) / 2
    assert int(acc.steps_L[0]) == 2
    torch.testing.assert_close(acc.counts_LEE[0], torch.outer(u0, u1) + torch.outer(u1, u2))
