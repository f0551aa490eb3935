"""Router rows of a micro-batch: position-major layout, sequence-parallel shards, packed (THD) micro-batches."""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("megatron.core", reason="megatron-core is an optional extra: pip install 'rpb[megatron]'")


from rpb.anchors import AnchorConfig
from rpb.integrations.megatron import (
    install_megatron_anchor,
    pack_thd,
    router_rows,
)
from tests.integrations.megatron.routers import (
    CASES,
    E,
    build_routers,
    hand_bias,
    make_logits,
    make_prior,
    reference,
)


# ----------------------------------------------------------------------------- token layout
def test_router_rows_position_major_and_sequence_parallel_shards():
    ids_BS = torch.arange(2 * 8).reshape(2, 8)  # value = row * 8 + position
    assert router_rows(ids_BS).tolist() == [b * 8 + s for s in range(8) for b in range(2)]
    for rank in range(2):
        expected = [b * 8 + s for s in range(4 * rank, 4 * rank + 4) for b in range(2)]
        assert router_rows(ids_BS, rank, 2, sequence_parallel=True).tolist() == expected
    assert router_rows(ids_BS, 1, 2, sequence_parallel=False).tolist() == router_rows(ids_BS).tolist()
    with pytest.raises(ValueError, match="divisible"):
        router_rows(ids_BS[:, :7], 0, 2, sequence_parallel=True)


def test_sequence_parallel_split_over_two_ranks_matches_the_whole_micro_batch():
    """Each simulated TP rank routes its sequence shard; together they equal the unsplit micro-batch."""
    case = CASES["sigmoid-bias-groups"]
    routers, pi = build_routers(case), make_prior()
    sample_BS = torch.tensor([[1, 1, 1, 1, 1, 1, 1, 1], [2, 2, 2, 2, 2, 2, -1, -1]])
    span_BS = torch.tensor([[-1, 0, 0, 0, -1, 1, 1, 1], [-1, 0, 0, 1, 1, 1, -1, -1]])
    logits = make_logits(seed=5, rows=2, positions=8)
    whole = install_megatron_anchor(routers, AnchorConfig(method="rpb"), prior=pi)
    whole.set_micro_batch(sample_BS, span_BS)
    expected = [r.routing(logits.clone()) for r in routers]
    whole.remove()
    for rank in range(2):
        # one process: the routers' TP group has size 1, so the rank and the split are given explicitly
        handle = install_megatron_anchor(
            routers, AnchorConfig(method="rpb"), prior=pi, tp_rank=rank, tp_size=2, sequence_parallel=True
        )
        handle.set_micro_batch(sample_BS, span_BS)
        rows = slice(rank * 4 * 2, (rank + 1) * 4 * 2)  # positions [4 rank, 4 rank + 4) x 2 rows
        for r, (probs, rmap) in zip(routers, expected, strict=True):
            shard_probs, shard_map = r.routing(logits[rank * 4 : (rank + 1) * 4].clone())
            assert torch.equal(shard_map, rmap[rows]) and torch.equal(shard_probs, probs[rows])
        with pytest.raises(RuntimeError, match="saw 16 tokens"):
            routers[0].routing(logits.clone())  # the whole sequence is not this rank's shard
        handle.remove()


def test_pack_thd_places_each_sequence_at_its_cu_seqlens_slot():
    sample_BS, span_BS = pack_thd([4, 0], [[-1, 0, 1], [-1, 0, 0, 1]], torch.tensor([0, 4, 8]), total_len=10)
    assert sample_BS.tolist() == [[4, 4, 4, -1, 0, 0, 0, 0, -1, -1]]
    assert span_BS.tolist() == [[-1, 0, 1, -1, -1, 0, 0, 1, -1, -1]]
    with pytest.raises(ValueError, match="slot holds"):
        pack_thd([1], [[0, 0, 0]], torch.tensor([0, 2]))


def test_packed_micro_batch_routes_each_token_as_unpacked():
    """A THD micro-batch [1, 10] gives every token the bias of its own (sample, span)."""
    case = CASES["softmax"]
    routers, pi = build_routers(case), make_prior()
    spans = [[-1, 0, 0, 1], [-1, 0, 1, 1, 1]]
    sample_BS, span_BS = pack_thd([1, 2], spans, torch.tensor([0, 4, 9]), total_len=10)
    logits = make_logits(seed=7, rows=1, positions=10)
    handle = install_megatron_anchor(routers, AnchorConfig(method="rpb"), prior=pi)
    handle.set_micro_batch(sample_BS, span_BS)
    probs_TE, map_TE = routers[1].routing(logits.clone())
    for t in range(10):
        sample, span = int(sample_BS[0, t]), int(span_BS[0, t])
        bias = hand_bias(pi[sample, span, 1]) if span >= 0 else [0.0] * E
        ids, weights = reference(case, logits[t, 0].tolist(), bias, None)
        assert map_TE[t].nonzero().flatten().tolist() == ids
        assert [float(probs_TE[t, e]) for e in ids] == pytest.approx([weights[e] for e in ids], abs=1e-6)
    handle.remove()
