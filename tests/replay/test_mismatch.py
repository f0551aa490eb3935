"""The mismatch figures against hand counts on small hand-built routings: two rollouts, a prompt of P = 2 and a
completion of C = 2 (S = 4 positions), L = 2 MoE layers, top-2."""

from __future__ import annotations

import math

import pytest
import torch

from rpb.replay.mismatch import agreed_for_completion, completion_positions, differs_BSL, flip_rate_L, logp_gap

P = 2

# the rollout's routing, [B, S, L, K]
ROLLOUT_BSLK = torch.tensor(
    [
        [[[0, 1], [2, 3]], [[1, 2], [3, 4]], [[4, 5], [6, 7]], [[0, 7], [1, 6]]],
        [[[3, 4], [5, 6]], [[0, 2], [4, 6]], [[1, 3], [5, 7]], [[2, 5], [0, 3]]],
    ]
)
# training's: the comment on each position says, per layer, whether its top-k *set* differs from the rollout's
TRAIN_BSLK = torch.tensor(
    [
        [
            [[1, 0], [2, 5]],  # same (reordered), differs
            [[2, 1], [4, 3]],  # same, same (both reordered)
            [[5, 4], [6, 0]],  # same (reordered), differs
            [[0, 6], [6, 1]],  # differs, same
        ],
        [
            [[3, 5], [5, 6]],  # differs, same
            [[0, 2], [4, 6]],  # same, same
            [[3, 1], [5, 6]],  # same (reordered), differs
            [[2, 4], [3, 0]],  # differs, same
        ],
    ]
)
DIFFERS_BSL = torch.tensor(
    [
        [[0, 1], [0, 0], [0, 1], [1, 0]],
        [[1, 0], [0, 0], [0, 1], [1, 0]],
    ]
).bool()
# rollout 1's completion is one token: its position 3 is padding
COMPLETION_MASK_BC = torch.tensor([[1, 1], [1, 0]])


def test_differs_is_per_set_not_per_order():
    assert torch.equal(differs_BSL(ROLLOUT_BSLK, TRAIN_BSLK), DIFFERS_BSL)
    assert not differs_BSL(ROLLOUT_BSLK, ROLLOUT_BSLK.flip(-1)).any()


def test_completion_positions_marks_the_completion_tokens_alone():
    want_BS = torch.tensor([[0, 0, 1, 1], [0, 0, 1, 0]]).bool()
    assert torch.equal(completion_positions(P, COMPLETION_MASK_BC), want_BS)


def test_flip_rate_counts_the_completion_tokens_by_hand():
    # counted: (0, 2), (0, 3), (1, 2). Layer 0 flips at (0, 3) alone; layer 1 at (0, 2) and (1, 2). The prompt's
    # flips ((0, 0) layer 1, (1, 0) layer 0) and the padding's ((1, 3) layer 0) count nowhere.
    rates_L = flip_rate_L(ROLLOUT_BSLK, TRAIN_BSLK, completion_positions(P, COMPLETION_MASK_BC))
    assert rates_L.tolist() == pytest.approx([1 / 3, 2 / 3])
    # every position counted (a long mask, as masks often are): layer 0 at (0, 3), (1, 0), (1, 3); layer 1 at
    # (0, 0), (0, 2), (1, 2)
    rates_L = flip_rate_L(ROLLOUT_BSLK, TRAIN_BSLK, torch.ones(2, 4, dtype=torch.long))
    assert rates_L.tolist() == pytest.approx([3 / 8, 3 / 8])


def test_flip_rate_ignores_the_order_of_the_k_ids():
    rates_L = flip_rate_L(ROLLOUT_BSLK, ROLLOUT_BSLK.flip(-1), torch.ones(2, 4, dtype=torch.bool))
    assert rates_L.tolist() == [0.0, 0.0]


def test_flip_rate_is_nan_where_nothing_is_counted():
    rates_L = flip_rate_L(ROLLOUT_BSLK, TRAIN_BSLK, torch.zeros(2, 4, dtype=torch.bool))
    assert rates_L.shape == (2,)
    assert all(math.isnan(r) for r in rates_L.tolist())


def test_agreed_for_completion_reads_the_position_before_each_token():
    # completion token c is read at position P + c - 1: token 0 at position 1, token 1 at position 2.
    # Rollout 0: position 1 agrees in both layers, position 2 differs in layer 1 -> [True, False].
    # Rollout 1: position 1 agrees, position 2 differs in layer 1 -> [True, False]. Position 3 (the last
    # token's, which reads no completion token) and position 0 (whose flips are the prompt's) never count.
    agreed_BC = agreed_for_completion(DIFFERS_BSL, P)
    assert torch.equal(agreed_BC, torch.tensor([[True, False], [True, False]]))
    # a longer prompt: P = 3, C = 1, token 0 read at position 2 alone
    assert torch.equal(agreed_for_completion(DIFFERS_BSL, 3), torch.tensor([[False], [False]]))
    # position 3 differing changes nothing; position 1 differing changes token 0
    differs_BSL_ = DIFFERS_BSL.clone()
    differs_BSL_[:, 3] = True
    differs_BSL_[1, 1, 0] = True
    assert torch.equal(agreed_for_completion(differs_BSL_, P), torch.tensor([[True, False], [False, False]]))


def test_logp_gap_means_and_counts_by_hand():
    rollout_BC = torch.tensor([[-1.0, -2.0], [-0.5, -3.0]])
    train_BC = torch.tensor([[-1.5, -2.25], [-0.5, -1.0]])
    agreed_BC = torch.tensor([[True, False], [True, True]])
    got = logp_gap(rollout_BC, train_BC, agreed_BC, COMPLETION_MASK_BC)
    # gaps 0.5, 0.25 / 0.0, (2.0 on padding: not counted). Agreed: 0.5 and 0.0; disagreed: 0.25
    assert got["agreed"] == pytest.approx(0.25) and got["agreed_tokens"] == 2
    assert got["disagreed"] == pytest.approx(0.25) and got["disagreed_tokens"] == 1
    assert got["all"] == pytest.approx(0.75 / 3) and got["all_tokens"] == 3  # every completion token, padding out
    agreed_BC = torch.tensor([[False, False], [True, False]])
    got = logp_gap(rollout_BC, train_BC, agreed_BC, COMPLETION_MASK_BC)
    assert got["agreed"] == 0.0 and got["agreed_tokens"] == 1
    assert got["disagreed"] == pytest.approx(0.375) and got["disagreed_tokens"] == 2


def test_logp_gap_is_nan_for_a_group_with_no_token():
    got = logp_gap(torch.zeros(2, 2), torch.ones(2, 2), torch.ones(2, 2, dtype=torch.bool), COMPLETION_MASK_BC)
    assert got["agreed"] == 1.0 and got["agreed_tokens"] == 3
    assert math.isnan(got["disagreed"]) and got["disagreed_tokens"] == 0
