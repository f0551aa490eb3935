"""``training_rows_agreement`` on two models whose routing is fixed by hand (``tests.fixed_routing``): the
post-trained model's overlap with the base's own sets and with the span prior's top-k, over the content tokens of
the sampled training rows, counted here from the token -> expert-set tables and the prior file's rows."""

from __future__ import annotations

import dataclasses
import random

import pytest
from safetensors.torch import load_file

import rpb.calibrate.agreement
from rpb.anchors.verify import PriorMismatchError
from rpb.calibrate.agreement import training_rows_agreement
from rpb.collect import collect
from rpb.prior import SPAN_A, SPAN_Q
from tests.conftest import qa, write_rows
from tests.fixed_routing import MOE_LAYERS, ROWS, E, K, expert_set, hand_tokens, save_fixed_routing

pytestmark = pytest.mark.usefixtures("one_thread")

SAMPLED, SEED = 4, 0


@pytest.fixture(scope="module")
def setup(tmp_path_factory, moon_tok):
    tmp = tmp_path_factory.mktemp("agreement")
    data = write_rows(tmp / "train.jsonl", [qa(q, a) for q, a in ROWS])
    base, post = (save_fixed_routing(tmp / name, name, moon_tok) for name in ("base", "post"))
    prior = tmp / "prior.safetensors"
    collect(str(base), data, prior, top_k=K, max_seq_len=128, progress=False, device="cpu")
    return base, post, prior, data


def hand_agreement(tok, prior) -> dict:
    """Sum over the sampled rows' Q and A tokens of |post ∩ base| and |post ∩ top-k of the row's span prior|,
    over k times the content tokens, per MoE layer."""
    vocab, pi_NSLE = tok.get_vocab(), load_file(prior)["prior_qa"]
    rows = sorted(random.Random(SEED).sample(range(len(ROWS)), SAMPLED))  # the documented seeded sample
    assert rows != list(range(SAMPLED))  # sampled rows are not the first ones: the row mapping matters
    hits = {"overlap_base": [0] * len(MOE_LAYERS), "overlap_prior": [0] * len(MOE_LAYERS)}
    content = 0
    for r in rows:
        _, q_ids, a_ids = hand_tokens(tok, *ROWS[r])
        content += len(q_ids) + len(a_ids)
        for span, ids in ((SPAN_Q, q_ids), (SPAN_A, a_ids)):
            for pos in range(len(MOE_LAYERS)):
                prior_E = pi_NSLE[r, span, pos].tolist()
                ranked = sorted(range(E), key=lambda e, p=prior_E: -p[e])
                assert prior_E[ranked[K - 1]] - prior_E[ranked[K]] > 1e-4  # the prior's top-k is no tie
                for v in ids:
                    post = set(expert_set("post", pos, v, vocab))
                    hits["overlap_base"][pos] += len(post & set(expert_set("base", pos, v, vocab)))
                    hits["overlap_prior"][pos] += len(post & set(ranked[:K]))
    out = {name: [h / (K * content) for h in per_layer] for name, per_layer in hits.items()}
    return out | {f"mean_{name}": sum(v) / len(v) for name, v in out.items()} | {"content_tokens": content}


def check_agreement(setup, tok) -> None:
    base, post, prior, data = setup
    got = training_rows_agreement(base, post, prior, data, rows=SAMPLED, seed=SEED, batch_size=2)
    expected = hand_agreement(tok, prior)
    for key, value in expected.items():
        assert got[key] == pytest.approx(value, abs=1e-12), f"{key}: {got[key]} differs from hand {value}"
    assert got["rows"] == SAMPLED and got["seed"] == SEED


def test_agreement_equals_the_hand_count(setup, moon_tok):
    expected = hand_agreement(moon_tok, setup[2])
    # the example can tell the two overlaps apart, and neither is trivially 0 or 1
    assert all(0 < v < 1 for name in ("overlap_base", "overlap_prior") for v in expected[name])
    assert expected["overlap_base"] != expected["overlap_prior"]
    check_agreement(setup, moon_tok)


def test_mutant_prior_row_off_by_one_is_caught(setup, moon_tok, monkeypatch):
    """The bug: each sampled row reads the span prior of the next row (a 1-based line number used as the
    0-based row index)."""
    load = rpb.calibrate.agreement.load_prior

    def shifted(path):
        artifact = load(path)
        return dataclasses.replace(artifact, prior_qa=artifact.prior_qa.roll(-1, dims=0))

    monkeypatch.setattr(rpb.calibrate.agreement, "load_prior", shifted)
    with pytest.raises(AssertionError, match=r"overlap_prior.* differs from hand"):
        check_agreement(setup, moon_tok)


def test_a_data_file_that_is_not_the_priors_is_refused(setup, tmp_path):
    """The rows are read back by position from the prior's own file, unchecked a second time: another file with
    as many rows would pair each row with another row's prior."""
    base, post, prior, _ = setup
    other = write_rows(tmp_path / "other.jsonl", [qa(a, q) for q, a in ROWS])  # as many rows, other contents
    with pytest.raises(PriorMismatchError, match=r"data_sha256: the prior has '[0-9a-f]{64}'"):
        training_rows_agreement(base, post, prior, other, rows=SAMPLED, seed=SEED, batch_size=2)
