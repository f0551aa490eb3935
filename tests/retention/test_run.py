"""Retention metrics on hand-built routing traces, and ``rpb retention`` end to end on tiny models."""

import json
import math

import pytest
import torch

from rpb.cli import main
from rpb.retention.run import build_report
from rpb.retention.stats import ModelRouting, PairedOverlap
from rpb.testing.data import conversations, write_jsonl
from tests.conftest import write_rows

E = 8


def trace(ids, spans=None):
    ids_TK = torch.tensor(ids)
    valid_T = torch.ones(len(ids), dtype=torch.bool)
    span_T = torch.tensor(spans) if spans is not None else torch.zeros(len(ids), dtype=torch.long)
    return ids_TK, valid_T, span_T


def report_for(traces_a, traces_b):
    a, b, ov = ModelRouting(1, E), ModelRouting(1, E), PairedOverlap(1, E)
    for (ids_a, valid, span), (ids_b, _, _) in zip(traces_a, traces_b, strict=True):
        a.add(0, ids_a, valid, span)
        b.add(0, ids_b, valid, span)
        ov.add(0, ids_a, ids_b, valid, span)
    info = {"base": "a", "post": "b", "data": "d", "rows": 1, "moe_layers": [3], "num_experts": E, "top_k": 2}
    return build_report(info, [a, b], ov, seed=0, resolution=1.0)


# two clear communities {0,1,2,3} and {4,5,6,7}: tokens pick pairs inside one block
BLOCKS = [[0, 1], [1, 2], [2, 3], [0, 3], [0, 2], [1, 3], [4, 5], [5, 6], [6, 7], [4, 7], [4, 6], [5, 7]] * 3


def test_identical_routing():
    r = report_for([trace(BLOCKS)], [trace(BLOCKS)])["layers"][0]
    assert r["tvd"] == 0 and r["jsd"] == pytest.approx(0, abs=1e-12)
    assert r["topk_overlap"] == 1 and r["nmi"] == pytest.approx(1)
    assert r["communities_base"] == 2 and r["modularity_base"] > 0.3


def test_disjoint_selections_overlap_zero_and_hand_divergences():
    base = [[0, 1], [2, 3]]
    post = [[4, 5], [6, 7]]
    r = report_for([trace(base)], [trace(post)])["layers"][0]
    assert r["topk_overlap"] == 0
    assert r["tvd"] == pytest.approx(1.0)  # disjoint supports
    assert r["jsd"] == pytest.approx(1.0)  # disjoint supports: 1 bit


def test_q_and_a_subsets_are_counted_separately():
    ids = [[0, 1], [0, 1], [4, 5], [4, 5]]
    post = [[0, 1], [0, 1], [6, 7], [6, 7]]
    r = report_for([trace(ids, [0, 0, 1, 1])], [trace(post, [0, 0, 1, 1])])["layers"][0]
    assert r["topk_overlap_q"] == 1 and r["topk_overlap_a"] == 0 and r["topk_overlap"] == 0.5
    assert r["tvd_q"] == 0 and r["tvd_a"] == pytest.approx(1.0)


def test_empty_selection_is_an_error():
    ids, _, span = trace([[0, 1]])
    with pytest.raises(ValueError, match="empty selection"):
        report_for([(ids, torch.zeros(1, dtype=torch.bool), span)], [(ids, torch.zeros(1, dtype=torch.bool), span)])


@pytest.fixture(scope="module")
def data(tmp_path_factory):
    return write_jsonl(conversations(24, seed=11), tmp_path_factory.mktemp("ret") / "data.jsonl")


def test_end_to_end_two_tiny_models(save_tiny, data, tmp_path, capsys):
    same = tmp_path / "same"
    assert (
        main(
            [
                "retention",
                "--base",
                str(save_tiny("moonlight")),
                "--post",
                str(save_tiny("moonlight")),
                "--data-jsonl",
                str(data),
                "--out",
                str(same),
                "--no-progress",
            ]
        )
        == 0
    )
    r = json.loads((same / "report.json").read_text())
    assert r["mean"]["tvd"] == 0 and r["mean"]["topk_overlap"] == 1 and r["mean"]["nmi"] == pytest.approx(1)
    other = tmp_path / "other"
    assert (
        main(
            [
                "retention",
                "--base",
                str(save_tiny("moonlight")),
                "--post",
                str(save_tiny("moonlight", seed=1)),
                "--data-jsonl",
                str(data),
                "--out",
                str(other),
                "--max-rows",
                "10",
                "--no-progress",
            ]
        )
        == 0
    )
    r = json.loads((other / "report.json").read_text())
    assert r["rows"] == 10 and 0 < r["mean"]["tvd"] <= 1 and r["mean"]["topk_overlap"] < 1
    assert r["tokens"]["Q"] + r["tokens"]["A"] < r["tokens"]["all"]
    for layer in r["layers"]:
        for key in ("tvd", "jsd", "topk_overlap", "nmi", "modularity_base", "modularity_post"):
            assert key in layer
    md = (other / "report.md").read_text()
    assert "| layer" in md.lower() or "layer |" in md.lower()
    for png in ("utilization.png", "layers.png", "coactivation_layer1.png"):
        assert (other / png).stat().st_size > 1000 and png in md


def test_single_model_description(save_tiny, data, tmp_path):
    assert (
        main(
            [
                "retention",
                "--base",
                str(save_tiny("qwen3_moe")),
                "--data-jsonl",
                str(data),
                "--out",
                str(tmp_path),
                "--no-progress",
            ]
        )
        == 0
    )
    r = json.loads((tmp_path / "report.json").read_text())
    assert r["post"] is None and "tvd" not in r["layers"][0]
    assert 0 < r["mean"]["entropy_base_bits"] <= 3  # log2(8 experts) = 3


def test_models_that_route_differently_are_refused(save_tiny, data, tmp_path, capsys):
    code = main(
        [
            "retention",
            "--base",
            str(save_tiny("moonlight")),
            "--post",
            str(save_tiny("mixtral")),
            "--data-jsonl",
            str(data),
            "--out",
            str(tmp_path),
            "--no-progress",
        ]
    )
    assert code == 2
    err = capsys.readouterr().err
    assert "moe_layers: base [1, 2], post [0, 1, 2]" in err


def test_bad_rows_are_reported_before_compute(save_tiny, tmp_path, capsys):
    bad = write_rows(tmp_path / "bad.jsonl", ["{", ""])
    assert (
        main(
            [
                "retention",
                "--base",
                str(save_tiny("moonlight")),
                "--data-jsonl",
                str(bad),
                "--out",
                str(tmp_path / "o"),
                "--no-progress",
            ]
        )
        == 2
    )
    assert "2 bad row(s)" in capsys.readouterr().err


def test_nmi_on_random_labelings_matches_the_textbook_formula():
    """NMI = I(A;B) / ((H(A) + H(B)) / 2), from contingency counts, on random labelings."""
    import random
    from collections import Counter

    from rpb.retention.communities import nmi

    def by_hand(a, b):
        n = len(a)
        h = lambda labels: -sum(c / n * math.log(c / n) for c in Counter(labels).values())  # noqa: E731
        pa, pb, pab = Counter(a), Counter(b), Counter(zip(a, b, strict=True))
        mi = sum(c / n * math.log(c * n / (pa[x] * pb[y])) for (x, y), c in pab.items())
        return mi / ((h(a) + h(b)) / 2)

    rng = random.Random(0)
    for _ in range(20):
        a = [rng.randrange(4) for _ in range(64)]
        b = [rng.randrange(5) for _ in range(64)]
        assert nmi(torch.tensor(a), torch.tensor(b)) == pytest.approx(by_hand(a, b), abs=1e-12)


def test_transitions_end_to_end(save_tiny, data, tmp_path):
    """--transitions: the fourth level in report.json / report.md and a heatmap per layer; a model against
    itself keeps its transition structure exactly, another model does not."""
    base = str(save_tiny("moonlight"))
    same, other = tmp_path / "same", tmp_path / "other"
    common = ["--data-jsonl", str(data), "--max-rows", "12", "--transitions", "--no-progress"]
    assert main(["retention", "--base", base, "--post", base, "--out", str(same), *common]) == 0
    assert (
        main(["retention", "--base", base, "--post", str(save_tiny("moonlight", seed=1)), "--out", str(other), *common])
        == 0
    )
    r_same, r_other = (json.loads((d / "report.json").read_text()) for d in (same, other))
    m = r_same["mean"]
    assert m["transition_nmi"] == pytest.approx(1) and m["transition_tvd"] == 0 and m["transition_row_jsd"] == 0
    assert r_other["mean"]["transition_tvd"] > 0 and r_other["mean"]["transition_row_jsd"] > 0
    for layer in r_other["layers"]:
        assert layer["transition_communities_base"] >= 1 and 0 <= layer["transition_self_share_base"] <= 1
    assert len(r_other["communities"]["transitions_base"]) == len(r_other["layers"])
    md = (other / "report.md").read_text()
    assert "## Transitions (fourth level)" in md and "transitions_layer1.png" in md
    assert (other / "transitions_layer1.png").stat().st_size > 1000


def test_step_transitions_end_to_end(save_tiny, tmp_path):
    """--steps-by: step_ figures beside the token-level ones, on answers of several lines."""
    rows = [
        {
            "messages": [
                {"role": "user", "content": f"sum {i}"},
                {"role": "assistant", "content": "\n".join(f"{j} + {i} = {i + j}" for j in range(6))},
            ]
        }
        for i in range(10)
    ]
    data = write_rows(tmp_path / "traces.jsonl", rows)
    base = str(save_tiny("moonlight"))
    out = tmp_path / "steps"
    assert (
        main(
            [
                "retention",
                "--base",
                base,
                "--post",
                str(save_tiny("moonlight", seed=1)),
                "--data-jsonl",
                str(data),
                "--out",
                str(out),
                "--steps-by",
                r"\n",
                "--no-progress",
            ]
        )
        == 0
    )
    r = json.loads((out / "report.json").read_text())
    assert r["steps_by"] == r"\n" and "transition_nmi" in r["mean"] and r["mean"]["step_transition_tvd"] > 0
    assert 0 <= r["mean"]["step_transition_nmi"] <= 1 and r["layers"][0]["step_transition_communities_base"] >= 1
    assert "## Step transitions" in (out / "report.md").read_text()
