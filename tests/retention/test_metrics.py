"""Pure retention metrics against hand-worked values and scipy."""

from __future__ import annotations

import math

import pytest
import torch
from scipy.stats import entropy

from rpb.retention.metrics import entropy_bits, jsd_bits, topk_overlap_T, tvd


def test_entropy_bits_of_counts_and_of_probabilities():
    assert float(entropy_bits(torch.tensor([1.0, 1.0, 1.0, 1.0]))) == pytest.approx(2.0)
    assert float(entropy_bits([3, 1, 0])) == pytest.approx(-(0.75 * math.log2(0.75) + 0.25 * math.log2(0.25)))
    p = torch.tensor([[0.2, 0.3, 0.5], [0.9, 0.1, 0.0]])
    assert entropy_bits(p).tolist() == pytest.approx([entropy(row, base=2) for row in p.tolist()])
    assert entropy_bits(p.T, dim=0).tolist() == pytest.approx(entropy_bits(p).tolist())


def test_hand_computed_tvd_jsd_and_overlap():
    p = [0.5, 0.5, 0.0]
    q = [0.25, 0.25, 0.5]
    assert tvd(p, q) == pytest.approx(0.5)
    m = [0.375, 0.375, 0.25]

    def kl(x, y):
        return sum(a * math.log2(a / b) for a, b in zip(x, y, strict=True) if a > 0)

    assert jsd_bits(p, q) == pytest.approx(0.5 * kl(p, m) + 0.5 * kl(q, m))
    a = torch.tensor([[0, 1, 2], [3, 4, 5]])
    b = torch.tensor([[2, 1, 7], [6, 7, 0]])
    assert topk_overlap_T(a, b, 8).tolist() == [2 / 3, 0.0]
