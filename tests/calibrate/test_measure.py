"""Row sums, set comparisons and the row bootstrap against hand-worked values."""

from __future__ import annotations

import pytest
import torch

from rpb.calibrate.measure import RowSums, ratio_with_ci, same_sets, set_overlap


def test_sets_compare_unordered():
    a = torch.tensor([[0, 1, 2], [3, 4, 5]])
    b = torch.tensor([[2, 0, 1], [3, 4, 6]])
    assert same_sets(a, b).tolist() == [True, False]
    assert set_overlap(a, b, 8).tolist() == [3, 2]


def test_row_sums_land_in_their_row_span_and_layer():
    sums = RowSums(quantities=2, rows=3, layers=2)
    sums.add(1, 0, torch.tensor([0, 2, 2]), torch.tensor([1, 0, 0]), torch.tensor([1.0, 2.0, 3.0]))
    assert sums.sums_QRSL[1, :, :, 0].tolist() == [[0, 1], [0, 0], [5, 0]]
    assert sums.sums_QRSL[0].abs().sum() == 0 and sums.sums_QRSL[1, :, :, 1].abs().sum() == 0


def test_ratio_is_a_ratio_of_sums_and_its_interval_a_row_bootstrap():
    # 4 rows, one layer: changed / content per row and span (Q, A)
    content = torch.tensor([[[10.0], [10.0]], [[10.0], [0.0]], [[5.0], [5.0]], [[20.0], [20.0]]])
    changed = torch.tensor([[[1.0], [9.0]], [[5.0], [0.0]], [[0.0], [5.0]], [[2.0], [2.0]]])[None]
    est = ratio_with_ci(changed, content, seed=0, resamples=4000)
    both, q, a = est["layers"][0, :, 0].tolist()
    assert both == pytest.approx(24 / 80) and q == pytest.approx(8 / 45) and a == pytest.approx(16 / 35)
    # the bootstrap by hand: multinomial row weights, the same ratio of weighted sums
    gen = torch.Generator().manual_seed(0)
    draws = torch.randint(4, (4000, 4), generator=gen)
    weights = torch.zeros(4000, 4, dtype=torch.float64).scatter_add_(1, draws, torch.ones(4000, 4, dtype=torch.float64))
    ratios = (weights @ changed[0].double().sum(1)[:, 0]) / (weights @ content.double().sum(1)[:, 0])
    lo, hi = est["layers_ci"][0, 0, 0].tolist()
    assert lo == pytest.approx(float(torch.quantile(ratios, 0.025))) and hi == pytest.approx(
        float(torch.quantile(ratios, 0.975))
    )
    assert lo < both < hi and est["mean"][0, 0] == pytest.approx(both)
