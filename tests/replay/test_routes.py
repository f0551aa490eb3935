"""Routes as they travel, against hand-built layouts: a padded batch of three rollouts (prompts left-padded to
P = 4, completions right-padded to C = 3), each rollout's routes read off it, and placed back into the same
layout and into TRL's re-padded one.

Every route id below is ``code(b, s, l, k) = 1000 b + 100 s + 10 l + k``: the batch row and position it was
recorded at stay readable in the value, so a route read from the wrong position or rollout cannot pass."""

from __future__ import annotations

import re

import pytest
import torch

from rpb.errors import ArgumentError
from rpb.replay import NO_ROUTE, batch_routes, rollout_routes, routed_positions

L, K = 2, 2

# rollout 0: prompt of 2 (positions 2, 3), completion of 3 (4, 5, 6)
# rollout 1: prompt of 4 (0..3), completion of 1 (4)
# rollout 2: prompt of 3 (1..3), completion of 2 (4, 5)
PROMPT_MASK_BP = torch.tensor([[0, 0, 1, 1], [1, 1, 1, 1], [0, 1, 1, 1]])
COMPLETION_MASK_BC = torch.tensor([[1, 1, 1], [1, 0, 0], [1, 1, 0]])


def code(b: int, s: int) -> list[list[int]]:
    """The [L, K] ids recorded at batch row b, position s."""
    return [[1000 * b + 100 * s + 10 * layer + k for k in range(K)] for layer in range(L)]


def generated_BSLK(S: int) -> torch.Tensor:
    """A recording over S positions of the padded batch: every position carries its code, pad or not (generation
    forwards pad positions too)."""
    return torch.tensor([[code(b, s) for s in range(S)] for b in range(3)])


def keep_BS() -> torch.Tensor:
    return torch.cat([PROMPT_MASK_BP, COMPLETION_MASK_BC], dim=1)


# each rollout's tokens but its last, by hand from the masks above
ROLLOUT_POSITIONS = {0: [2, 3, 4, 5], 1: [0, 1, 2, 3], 2: [1, 2, 3, 4]}


def expected_rollouts() -> list[torch.Tensor]:
    return [torch.tensor([code(b, s) for s in ROLLOUT_POSITIONS[b]]) for b in range(3)]


@pytest.mark.parametrize("S", [6, 7], ids=["generation-one-shorter", "full-length"])
def test_rollout_routes_reads_each_rollouts_tokens_but_its_last(S):
    got = rollout_routes(generated_BSLK(S), keep_BS())
    assert len(got) == 3
    for b, want_NLK in enumerate(expected_rollouts()):
        assert got[b].shape == (len(ROLLOUT_POSITIONS[b]), L, K)
        assert torch.equal(got[b], want_NLK), b


def test_rollout_routes_refuses_a_recording_that_fits_no_batch():
    with pytest.raises(ArgumentError, match=re.escape("do not fit a batch of 3 x 7 tokens")):
        rollout_routes(generated_BSLK(5), keep_BS())
    with pytest.raises(ArgumentError, match=re.escape("do not fit a batch of 3 x 7 tokens")):
        rollout_routes(generated_BSLK(7)[:2], keep_BS())


def test_batch_routes_places_each_rollout_on_its_tokens():
    got_BSLK = batch_routes(expected_rollouts(), PROMPT_MASK_BP, COMPLETION_MASK_BC)
    want_BSLK = torch.full((3, 7, L, K), NO_ROUTE, dtype=torch.long)
    want_BSLK[0, 2:6] = torch.tensor([code(0, s) for s in (2, 3, 4, 5)])  # position 6, its last token: none
    want_BSLK[1, 0:4] = torch.tensor([code(1, s) for s in (0, 1, 2, 3)])  # 4 last; 5, 6 padding
    want_BSLK[2, 1:5] = torch.tensor([code(2, s) for s in (1, 2, 3, 4)])  # 0 padding; 5 last; 6 padding
    assert got_BSLK.dtype == torch.int16  # expert ids and -1 fit: the narrow type
    assert torch.equal(got_BSLK.long(), want_BSLK)
    assert torch.equal(
        routed_positions(got_BSLK),
        torch.tensor(
            [
                [0, 0, 1, 1, 1, 1, 0],
                [1, 1, 1, 1, 0, 0, 0],
                [0, 1, 1, 1, 1, 0, 0],
            ]
        ).bool(),
    )


def test_batch_routes_into_trls_repadded_layout():
    """Generation's batch (P = 4, C = 3) where rollout 0 drew EOS as its second completion token: TRL cuts its
    completion after EOS and re-pads the batch, here to P = 5 (a longer prompt elsewhere in its batch) and C = 2
    (the longest completion left)."""
    trl_completion_BC = torch.tensor([[1, 1, 0], [1, 0, 0], [1, 1, 0]])  # rollout 0 ends at its EOS
    rollouts = rollout_routes(generated_BSLK(6), torch.cat([PROMPT_MASK_BP, trl_completion_BC], dim=1))
    # rollout 0 is now its prompt (2, 3) and completion (4, EOS at 5): routes of 2, 3, 4
    assert torch.equal(rollouts[0], torch.tensor([code(0, 2), code(0, 3), code(0, 4)]))
    prompt_mask_BP = torch.tensor([[0, 0, 0, 1, 1], [0, 1, 1, 1, 1], [0, 0, 1, 1, 1]])
    completion_mask_BC = torch.tensor([[1, 1], [1, 0], [1, 1]])
    got_BSLK = batch_routes(rollouts, prompt_mask_BP, completion_mask_BC)
    want_BSLK = torch.full((3, 7, L, K), NO_ROUTE, dtype=torch.long)
    # new position <- generation's position: rollout 0: 3 <- 2, 4 <- 3, 5 <- 4 (6, the EOS, has none)
    want_BSLK[0, 3:6] = torch.tensor([code(0, 2), code(0, 3), code(0, 4)])
    # rollout 1: 1..4 <- 0..3 (5, its only completion token, is its last)
    want_BSLK[1, 1:5] = torch.tensor([code(1, 0), code(1, 1), code(1, 2), code(1, 3)])
    # rollout 2: 2..5 <- 1..4 (6 its last)
    want_BSLK[2, 2:6] = torch.tensor([code(2, 1), code(2, 2), code(2, 3), code(2, 4)])
    assert torch.equal(got_BSLK.long(), want_BSLK)


def test_batch_routes_lists_every_rollout_whose_count_is_not_its_tokens_but_one():
    rollouts = expected_rollouts()
    rollouts[0] = torch.cat([rollouts[0], rollouts[0][-1:]])  # 5 routes for 5 tokens
    rollouts[2] = rollouts[2][:-2]  # 2 routes for 5 tokens
    with pytest.raises(ArgumentError) as info:
        batch_routes(rollouts, PROMPT_MASK_BP, COMPLETION_MASK_BC)
    message = str(info.value)
    assert "rollout 0: 5 routes" in message and "rollout 2: 2 routes" in message
    assert "rollout 1" not in message


def test_batch_routes_refuses_a_rollout_of_other_layers_or_top_k():
    rollouts = expected_rollouts()
    rollouts[1] = rollouts[1][:, :1]  # one layer where the others have two
    with pytest.raises(ArgumentError, match=r"rollout 1: 4 routes of \(1, 2\)"):
        batch_routes(rollouts, PROMPT_MASK_BP, COMPLETION_MASK_BC)


def test_batch_routes_refuses_another_batchs_count_of_rollouts():
    with pytest.raises(ArgumentError, match=re.escape("2 rollouts' routes for a batch of 3")):
        batch_routes(expected_rollouts()[:2], PROMPT_MASK_BP, COMPLETION_MASK_BC)


def test_routed_positions_needs_every_layers_ids():
    routes_BSLK = torch.tensor(
        [
            [[[0, 1], [2, 3]], [[0, -1], [2, 3]], [[0, 1], [-1, -1]], [[-1, -1], [-1, -1]]],
            [[[7, 0], [5, 6]], [[4, 4], [0, 0]], [[1, 2], [3, -1]], [[3, 2], [1, 0]]],
        ]
    )
    assert torch.equal(routed_positions(routes_BSLK), torch.tensor([[1, 0, 0, 0], [1, 1, 0, 1]]).bool())
