"""``rpb retention`` end to end on two models whose routing is fixed by hand (``tests.fixed_routing``): every
figure of report.json against the same figure computed here from the token -> expert-set tables over the tokens
docs/retention.md says count (all non-padding tokens; the Q and A content tokens).

Every level is checked exactly: utilization TVD / JSD, top-k overlap, and the communities too, because each
token's set is one of its layer's expert pairs: the co-activation graph is a disjoint union of edges, whose
Louvain partition is certain (each used pair, unused experts alone), with modularity 1 - sum_c f_c^2
(f_c: the share of tokens that chose pair c); NMI is scikit-learn's on those hand partitions.
"""

from __future__ import annotations

import json
import math

import pytest
import torch
from sklearn.metrics import normalized_mutual_info_score

import rpb.retention.stats
from rpb.prior import SPAN_A, SPAN_Q
from rpb.retention.run import run_retention
from tests.conftest import qa, write_rows
from tests.fixed_routing import (
    BASE_PAIRS,
    MOE_LAYERS,
    POST_PAIRS_0,
    ROWS,
    E,
    K,
    expert_set,
    hand_tokens,
    save_fixed_routing,
)

pytestmark = pytest.mark.usefixtures("one_thread")

SUFFIX = {"all": "", "Q": "_q", "A": "_a"}


@pytest.fixture(scope="module")
def fixed(tmp_path_factory, moon_tok):
    tmp = tmp_path_factory.mktemp("retention-hand")
    data = write_rows(tmp / "data.jsonl", [qa(q, a) for q, a in ROWS])
    return save_fixed_routing(tmp / "base", "base", moon_tok), save_fixed_routing(tmp / "post", "post", moon_tok), data


def utilization(sets: list[tuple[int, int]]) -> list[float]:
    counts = [0] * E
    for s in sets:
        for e in s:
            counts[e] += 1
    return [c / (K * len(sets)) for c in counts]


def jsd_bits(p: list[float], q: list[float]) -> float:
    m = [(a + b) / 2 for a, b in zip(p, q, strict=True)]
    kl = lambda x: sum(a * math.log2(a / c) for a, c in zip(x, m, strict=True) if a > 0)  # noqa: E731
    return (kl(p) + kl(q)) / 2


def partition(sets: list[tuple[int, int]], pairs) -> tuple[list[int], float]:
    """Louvain's certain answer on a disjoint union of edges: labels (each used pair one community, each expert
    of an unused pair alone) and the modularity 1 - sum_c f_c^2."""
    labels, shares = list(range(E)), []  # every expert alone ...
    for first, second in pairs:
        used = sum(tuple(s) == (first, second) for s in sets)
        if used:  # ... unless its pair was chosen
            labels[second] = labels[first]
            shares.append(used / len(sets))
    return labels, 1 - sum(f * f for f in shares)


def hand_report(tok) -> dict:
    """Per MoE layer, every figure the report gives, from the tables over the counted tokens."""
    vocab = tok.get_vocab()
    tokens = {"all": [], "Q": [], "A": []}
    for q, a in ROWS:
        all_ids, q_ids, a_ids = hand_tokens(tok, q, a)
        tokens["all"] += all_ids
        tokens["Q"] += q_ids
        tokens["A"] += a_ids
    layers = []
    for pos, layer in enumerate(MOE_LAYERS):
        row = {"layer": layer}
        for name, ids in tokens.items():
            base = [expert_set("base", pos, v, vocab) for v in ids]
            post = [expert_set("post", pos, v, vocab) for v in ids]
            p_E, q_E = utilization(base), utilization(post)
            shared = sum(len(set(a) & set(b)) for a, b in zip(base, post, strict=True))
            row["tvd" + SUFFIX[name]] = 0.5 * sum(abs(a - b) for a, b in zip(p_E, q_E, strict=True))
            row["jsd" + SUFFIX[name]] = jsd_bits(p_E, q_E)
            row["topk_overlap" + SUFFIX[name]] = shared / (K * len(ids))
            if name == "all":
                lab_b, mod_b = partition(base, BASE_PAIRS)
                lab_p, mod_p = partition(post, POST_PAIRS_0 if pos == 0 else BASE_PAIRS)
                row |= {
                    "entropy_base_bits": -sum(u * math.log2(u) for u in p_E if u > 0),
                    "entropy_post_bits": -sum(u * math.log2(u) for u in q_E if u > 0),
                    "communities_base": len(set(lab_b)),
                    "communities_post": len(set(lab_p)),
                    "modularity_base": mod_b,
                    "modularity_post": mod_p,
                    "nmi": normalized_mutual_info_score(lab_b, lab_p),
                }
        layers.append(row)
    mean = {k: sum(r[k] for r in layers) / len(layers) for k in layers[0] if k != "layer"}
    return {"layers": layers, "mean": mean, "tokens": {name: len(ids) for name, ids in tokens.items()}}


@pytest.fixture(scope="module")
def expected(moon_tok):
    return hand_report(moon_tok)


def check_retention_matches_hand(fixed, expected, out) -> None:
    """Run ``rpb retention``'s entry point and compare report.json, figure by figure, with the hand report."""
    base, post, data = fixed
    run_retention(str(base), data, out, post=str(post), batch_size=4, device="cpu", progress=False)
    report = json.loads((out / "report.json").read_text())
    assert [r["layer"] for r in report["layers"]] == list(MOE_LAYERS)
    for got, want in zip(report["layers"], expected["layers"], strict=True):
        for key, value in want.items():
            assert got[key] == pytest.approx(value, abs=1e-12), f"layer {want['layer']} {key} differs from hand"
    for key, value in expected["mean"].items():
        assert report["mean"][key] == pytest.approx(value, abs=1e-12), f"mean {key} differs from hand"
    assert report["tokens"] == expected["tokens"], "token counts differ from hand"


def test_retention_figures_equal_the_hand_tables(fixed, expected, tmp_path):
    # the design the mutants rely on: the subsets disagree (second MoE layer: the post moves letters only, never
    # the question's digits), and the communities change in the first MoE layer only
    first, second = expected["layers"]
    assert second["tvd_q"] == 0 and second["topk_overlap_q"] == 1 and second["tvd"] > 0.05 and second["tvd_a"] > 0.05
    assert first["tvd_q"] != first["tvd"] and first["nmi"] < 0.9 and second["nmi"] == pytest.approx(1)
    check_retention_matches_hand(fixed, expected, tmp_path)


def test_mutant_question_span_counts_every_token_is_caught(fixed, expected, tmp_path, monkeypatch):
    """The bug: the Q subset forgets the span label, so every non-padding token counts as a question token."""
    monkeypatch.setattr(
        rpb.retention.stats, "subset_masks", lambda valid_T, span_T: [valid_T, valid_T, valid_T & (span_T == SPAN_A)]
    )
    with pytest.raises(AssertionError, match=r"layer \d (tvd|jsd|topk_overlap)_q differs"):
        check_retention_matches_hand(fixed, expected, tmp_path)


def test_mutant_padding_counts_is_caught(fixed, expected, tmp_path, monkeypatch):
    """The bug: the attention mask is ignored, so the padding of shorter rows counts among all tokens."""
    monkeypatch.setattr(
        rpb.retention.stats,
        "subset_masks",
        lambda valid_T, span_T: [torch.ones_like(valid_T), valid_T & (span_T == SPAN_Q), valid_T & (span_T == SPAN_A)],
    )
    with pytest.raises(AssertionError, match=r"layer \d (tvd|jsd|topk_overlap) differs"):
        check_retention_matches_hand(fixed, expected, tmp_path)
