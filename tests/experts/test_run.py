"""``rpb experts`` on a model whose routing is fixed by hand (tests/fixed_routing.py): both of ESFT's measures
against hand computations from the table, the choice rule, bad expert configs."""

from __future__ import annotations

import json
import logging
import math

import pytest
import torch
from transformers import AutoModelForCausalLM

from rpb.cli import main
from rpb.collect import collect
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


@pytest.fixture(scope="module")
def two_unused(fixed, tmp_path_factory):
    """The fixed-routing base with its second MoE layer's pair (6, 7) sent to (4, 5) instead: the router never
    selects experts 6 and 7 there, while its probabilities still give them a share; its own prior."""
    model_dir, data, _, tok = fixed
    tmp = tmp_path_factory.mktemp("unused")
    lm = AutoModelForCausalLM.from_pretrained(model_dir)
    with torch.no_grad():
        w_EH = lm.model.layers[MOE_LAYERS[1]].mlp.gate.weight
        w_EH[4:6] += w_EH[6:8]  # each token's column has weight on its own pair only: a pure relabelling
        w_EH[6:8] = 0.0
    lm.save_pretrained(tmp / "base")
    tok.save_pretrained(tmp / "base")
    prior = tmp / "prior.safetensors"
    collect(str(tmp / "base"), data, prior, top_k=K, max_seq_len=128, progress=False)
    return tmp / "base", data, prior, tok


def test_a_chosen_expert_the_router_never_selects_is_named(two_unused, tmp_path, caplog):
    model, data, prior, tok = two_unused
    vocab, selected = tok.get_vocab(), {layer: set() for layer in MOE_LAYERS}
    for q, a in ROWS:  # the hand table, relabelled as the fixture did, over the answers' tokens
        for v in hand_tokens(tok, q, a)[2]:
            for pos, layer in enumerate(MOE_LAYERS):
                pair = expert_set("base", pos, v, vocab)
                selected[layer] |= {4, 5} if pos == 1 and pair == (6, 7) else set(pair)
    want = {str(layer): sorted(set(range(E)) - ids) for layer, ids in selected.items() if set(range(E)) - ids}
    assert want == {str(MOE_LAYERS[1]): [6, 7]}
    out = tmp_path / "experts.json"
    # the gate measure gives every expert a share (a softmax): with --top-n 8 it chooses the two never selected
    common = ["experts", "--prior", str(prior), "--out", str(out), "--measure", "gate", "--span", "answer",
              "--top-n", str(E), "--no-progress"]  # fmt: skip
    with caplog.at_level(logging.WARNING, logger="rpb.experts.run"):
        assert main([*common, "--model", str(model), "--data-jsonl", str(data)]) == 0
    assert json.loads(out.read_text())["rpb"]["never_selected"] == want
    assert "2 chosen experts are never selected" in caplog.text and "layer 2: [6, 7]" in caplog.text
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="rpb.experts.run"):
        assert main(common) == 0  # without the base and the data: one line says the check did not run
    assert json.loads(out.read_text())["rpb"]["never_selected"] is None
    lines = [r.getMessage() for r in caplog.records]
    assert len(lines) == 1 and "not checked" in lines[0] and "--model" in lines[0] and "--data-jsonl" in lines[0]
