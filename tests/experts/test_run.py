"""``rpb experts`` on a model whose routing is fixed by hand (tests/fixed_routing.py): both of ESFT's measures
against hand computations from the table, the choice rule, bad expert configs."""

from __future__ import annotations

import json
import math

import pytest
import torch

from rpb.cli import main
from rpb.experts import choose, read_choice
from rpb.experts.run import MEASURES
from tests.fixed_routing import MOE_LAYERS, ROWS, E, K, expert_set, hand_tokens

pytestmark = pytest.mark.usefixtures("one_thread")


def hand_scores(tok, measure: str, pos: int) -> list[float]:
    """Per expert, over the answers' tokens: the mean per sample of the softmax of the table's logits (2 + v/16
    for the first expert, 1 for the second, 0 else), or the share of the sample's K selections."""
    vocab, per_sample = tok.get_vocab(), []
    for q, a in ROWS:
        _, _, a_ids = hand_tokens(tok, q, a)
        total = [0.0] * E
        for v in a_ids:
            first, second = expert_set("base", pos, v, vocab)
            if measure == "token":
                total[first] += 1 / K
                total[second] += 1 / K
            else:
                logits = [0.0] * E
                logits[first], logits[second] = 2 + v / 16, 1.0
                z = sum(math.exp(x) for x in logits)
                total = [t + math.exp(x) / z for t, x in zip(total, logits, strict=True)]
        per_sample.append([t / len(a_ids) for t in total])
    return [sum(s[e] for s in per_sample) / len(per_sample) for e in range(E)]


def hand_choice(scores: list[float], top_n: int) -> list[int]:
    return sorted(range(E), key=lambda e: (-scores[e], e))[:top_n]


@pytest.mark.parametrize("measure", MEASURES)
def test_rpb_experts_finds_the_experts_the_table_routes_to(fixed, tmp_path, measure):
    model, data, prior, tok = fixed
    out = tmp_path / "experts.json"
    extra = ["--model", str(model), "--data-jsonl", str(data)] if measure == "token" else []
    assert main(["experts", "--prior", str(prior), "--out", str(out), "--measure", measure, "--span", "answer",
                 "--top-n", "3", "--no-progress", *extra]) == 0  # fmt: skip
    body = json.loads(out.read_text())
    assert {"experts", "shared_experts", "non_expert_modules"} <= body.keys()
    for pos, layer in enumerate(MOE_LAYERS):
        want = hand_scores(tok, measure, pos)
        # gate: the router sees the RMS-normalised embedding, whose eps moves the scores by ~1e-4 relative
        tolerance = {"rel": 1e-4, "abs": 1e-5} if measure == "gate" else {"abs": 1e-6}
        assert body["rpb"]["scores"][str(layer)] == pytest.approx(want, **tolerance)
        assert body["experts"][str(layer)] == hand_choice(want, 3)


def test_the_cumulative_threshold_takes_experts_until_their_share_reaches_it():
    scores = torch.tensor([[0.1, 0.4, 0.3, 0.2], [0.25, 0.25, 0.25, 0.25]])
    assert choose(scores, threshold=0.65) == [[1, 2], [0, 1, 2]]  # 0.4 + 0.3 >= 0.65; ties to the lower id
    assert choose(scores, top_n=1) == [[1], [0]]


def test_a_bad_expert_config_is_refused_with_every_problem(tmp_path):
    bad = tmp_path / "bad.json"
    bad.write_text(json.dumps({"experts": {"x": [1], "2": [-1, "a"]}, "shared_experts": "yes"}))
    with pytest.raises(Exception, match=r"(?s)key 'x'.*experts\.2.*shared_experts") as err:
        read_choice(bad)
    assert str(bad) in str(err.value)
