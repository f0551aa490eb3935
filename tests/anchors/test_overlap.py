"""The overlap counts against hand-written sets: shared experts over k, the tokens counted (padding and, in GRPO,
the tokens the reference routing does not cover, left out), the base's choice from its logits by the family's rule
(correction bias included), and the measure over layers."""

from __future__ import annotations

import torch

from rpb.anchors.overlap import OverlapCounts, base_topk
from rpb.routing import RouterSpec
from rpb.teacher.routing import BaseRouting


def test_counts_and_measure_by_hand():
    model_TK = torch.tensor([[0, 1], [2, 3], [0, 3], [1, 2]])
    base = BaseRouting(ids_LTK=torch.tensor([[[1, 0], [0, 1], [3, 2], [1, 2]], [[0, 1], [2, 3], [0, 3], [1, 2]]]),
                       known_T=torch.tensor([True, True, True, False]))  # fmt: skip
    counts = OverlapCounts(2)
    spec = RouterSpec(num_experts=4, top_k=2, score_function="softmax")
    weight_T = torch.tensor([0.5, 0.5, 0.0, 0.2])  # token 2 is padding; token 3 the reference does not cover
    counts.count(0, base, spec, None, model_TK, weight_T)
    counts.count(1, base, spec, None, model_TK, weight_T)
    # layer 0: token 0 shares {0, 1} (2/2), token 1 shares nothing (0/2); layer 1: both whole
    assert counts.shared_L.tolist() == [1.0, 2.0] and counts.tokens_L.tolist() == [2.0, 2.0]
    assert counts.measure() == (0.75, 0.5)
    counts.from_flat(counts.flat() * 2)  # as two ranks' sums: the same measure
    assert counts.measure() == (0.75, 0.5)
    counts.reset()
    assert counts.measure() is None


def test_the_base_choice_reads_the_correction_bias():
    logits_TE = torch.tensor([[2.0, 1.9, 0.0, -1.0]])
    spec = RouterSpec(num_experts=4, top_k=1, score_function="sigmoid")
    base = BaseRouting(logits_LTE=[logits_TE])
    assert base_topk(base, 0, spec, None, "cpu").tolist() == [[0]]
    assert base_topk(base, 0, spec, torch.tensor([0.0, 0.5, 0.0, 0.0]), "cpu").tolist() == [[1]]
