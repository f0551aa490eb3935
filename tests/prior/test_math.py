"""Eq. 2 and eq. 3 against values worked out by hand."""

import math

import pytest
import torch

from rpb.prior import STRUCTURAL, clip_prior, log_prior_bias, router_probs, span_means


def test_softmax_transform_golden():
    # exp(0), exp(ln 2), exp(ln 3) = 1, 2, 3 -> 1/6, 2/6, 3/6
    z = torch.tensor([[0.0, math.log(2), math.log(3)]])
    assert torch.allclose(router_probs(z, "softmax"), torch.tensor([[1 / 6, 2 / 6, 3 / 6]]), atol=1e-7)


def test_sigmoid_normalized_transform_golden():
    # sigmoid(0) = 1/2, sigmoid(ln 3) = 3/4 -> (1/2, 3/4) / (5/4) = (0.4, 0.6)
    z = torch.tensor([[0.0, math.log(3)]])
    assert torch.allclose(router_probs(z, "sigmoid-normalized"), torch.tensor([[0.4, 0.6]]), atol=1e-7)


def test_unknown_transform_is_refused():
    with pytest.raises(ValueError, match="unknown router transform"):
        router_probs(torch.zeros(1, 2), "sparsemax")


def test_span_means_golden_and_padding_never_counts():
    probs = torch.tensor(
        [
            [
                [0.5, 0.5, 0.0],  # Q
                [0.1, 0.3, 0.6],  # Q
                [0.2, 0.2, 0.6],  # A
                [1.0, 0.0, 0.0],  # structural
                [0.0, 0.0, 1.0],  # padding
            ]
        ]
    )
    spans = torch.tensor([[0, 0, 1, STRUCTURAL, STRUCTURAL]])
    pi, counts = span_means(probs, spans)
    assert counts.tolist() == [[2, 1]]
    assert torch.allclose(pi[0, 0], torch.tensor([0.3, 0.4, 0.3]))  # (0.5+0.1)/2, (0.5+0.3)/2, (0+0.6)/2
    assert torch.allclose(pi[0, 1], torch.tensor([0.2, 0.2, 0.6]))


def test_clip_and_bias_golden():
    # E = 4, eps = 0.05, C = 5: clamp to [0.0125, 1.25]; (0.7, 0.2, 0.1, 0) -> (0.7, 0.2, 0.1, 0.0125)
    # sum 1.0125 -> q = (0.691358, 0.197531, 0.098765, 0.012346)
    pi = torch.tensor([0.7, 0.2, 0.1, 0.0])
    q = clip_prior(pi)
    assert torch.allclose(q, torch.tensor([0.691358, 0.197531, 0.098765, 0.012346]), atol=1e-6)
    # log q = (-0.369097, -1.621860, -2.315008, -4.394449); mean = -2.175104
    # b = log q - mean = (1.806006, 0.553243, -0.139904, -2.219345)
    b = log_prior_bias(pi)
    assert torch.allclose(b, torch.tensor([1.806006, 0.553243, -0.139904, -2.219345]), atol=1e-5)
    assert abs(float(b.sum())) < 1e-5


def test_bias_upper_clip_golden():
    # E = 2, C = 1.5: bounds [0.025, 0.75]; (0.9, 0.1) -> (0.75, 0.1) / 0.85 = (0.882353, 0.117647)
    # log ratio = ln(7.5) = 2.014903 -> b = (+1.007451, -1.007451)
    b = log_prior_bias(torch.tensor([[0.9, 0.1]]), eps=0.05, clip=1.5)
    assert torch.allclose(b, torch.tensor([[1.007451, -1.007451]]), atol=1e-5)


def test_uniform_prior_gives_zero_bias_and_shapes_broadcast():
    pi = torch.full((3, 2, 5, 8), 1 / 8)
    b = log_prior_bias(pi)
    assert b.shape == pi.shape
    assert torch.allclose(b, torch.zeros_like(b), atol=1e-6)


def test_bad_clip_bounds_are_refused():
    with pytest.raises(ValueError, match="eps"):
        clip_prior(torch.ones(4) / 4, eps=2.0, clip=5.0)


def test_selection_sums_golden_and_padding_never_counts():
    from rpb.prior import selection_sums, span_counts

    # one row of 4 positions: Q, Q, A, padding; top-2 of 4 experts
    ids_BTK = torch.tensor([[[0, 1], [1, 2], [3, 0], [2, 3]]])
    span_BT = torch.tensor([[0, 0, 1, STRUCTURAL]])
    sums_BSE = selection_sums(ids_BTK, span_BT, num_experts=4)
    # Q: expert 0 once, 1 twice, 2 once, each 1/2; A: experts 3 and 0, each 1/2
    assert sums_BSE.tolist() == [[[0.5, 1.0, 0.5, 0.0], [0.5, 0.0, 0.0, 0.5]]]
    freq_BSE = sums_BSE / span_counts(span_BT)[..., None]
    assert torch.allclose(freq_BSE.sum(-1), torch.ones(1, 2))  # a row of the frequency prior sums to 1


def test_clipped_share_golden():
    from rpb.prior import clipped_share

    prior = torch.tensor([[[[0.0, 0.5, 0.5, 0.0]], [[0.25, 0.25, 0.25, 0.25]]]])  # [N=1, S=2, L=1, E=4]
    assert clipped_share(prior).tolist() == [[0.5], [0.0]]
