"""The clip's share per span and layer, against values counted by hand."""

from __future__ import annotations

import torch

from rpb.collect import clip
from rpb.collect.clip import clip_table, clipped_shares


def test_shares_are_counted_by_hand_and_blocks_do_not_change_them(monkeypatch):
    # 3 rows, 2 spans, 2 layers, 4 experts; eps/E = 0.0125: zeros and 0.01 are lifted, 0.0125 is not
    prior = torch.full((3, 2, 2, 4), 0.25)
    prior[0, 0, 0] = torch.tensor([0.0, 0.01, 0.4875, 0.5025])  # 2 of 4 lifted
    prior[1, 0, 0] = torch.tensor([0.0125, 0.3, 0.3, 0.3875])  # none
    prior[2, 1, 1] = torch.tensor([0.0, 0.0, 0.0, 1.0])  # 3 of 4
    expected = torch.tensor([[2 / 12, 0.0], [0.0, 3 / 12]])
    assert torch.allclose(clipped_shares(prior), expected)
    monkeypatch.setattr(clip, "BLOCK_ROWS", 2)  # rows 0-1, then row 2: the same shares
    assert torch.allclose(clipped_shares(prior), expected)
    text = clip_table(expected, [3, 7], "frequency")
    assert "span Q: layers 3..7: 16.7% 0.0%" in text and "span A: layers 3..7: 0.0% 25.0%" in text
