"""The revert test's measurements against computations made apart from them: each row's answer NLL against a
forward of that row alone with the loss read by hand from the log-softmax, exact match against greedy decoding of
each prompt alone (no padding), the overlap against the routers' own choices; the variants' routers are the ones
they say, and each model is its own again after."""

from __future__ import annotations

import copy

import pytest
import torch

from rpb.adapters import find_moe_layers, get_adapter
from rpb.adapters.fingerprint import router_tensors
from rpb.data import load_labelled
from rpb.data.batches import answer_mask
from rpb.models import load_causal_lm, load_tokenizer, pad_id_of
from rpb.prior import SPAN_A, SPAN_Q, STRUCTURAL
from rpb.retention.revert import (
    BASE,
    POST,
    REVERSED,
    REVERTED,
    Pair,
    answer_budget,
    generate_domain,
    measure_domain,
    prompt_and_answer,
    variants,
)
from rpb.testing import replica as build_replica
from rpb.testing.data import conversations, write_jsonl
from tests.test_routing import reference_route

pytestmark = pytest.mark.usefixtures("one_thread")
FAMILY = "deepseek_v3"


@pytest.fixture(scope="module")
def rows(replica, tmp_path_factory):
    """(model dir, labelled examples, tokenizer): eight rows of the shared DeepSeek-V3 replica."""
    tmp = tmp_path_factory.mktemp("revert-core")
    model_dir = replica(FAMILY)
    tok = load_tokenizer(str(model_dir))
    data = write_jsonl(conversations(8, seed=3), tmp / "d.jsonl")
    return model_dir, load_labelled(data, tok, 512).examples, tok


def _pair(base, post) -> Pair:
    facts = get_adapter(base.config.model_type)
    return Pair(base, post, find_moe_layers(base, facts), find_moe_layers(post, facts), facts)


def _moved_routers(model, seed=3, scale=0.5):
    out = copy.deepcopy(model)
    gen = torch.Generator().manual_seed(seed)
    facts = get_adapter(model.config.model_type)
    with torch.no_grad():
        for m in find_moe_layers(out, facts):
            for t in router_tensors(m, facts).values():
                t.add_(torch.randn(t.shape, generator=gen).to(t.dtype) * scale)
    return out


def _hand_nll(model, example) -> float:
    """The row alone: -log p of each answer-mask token given the tokens before it, averaged."""
    ids = torch.tensor([example.input_ids])
    with torch.no_grad():
        logp = torch.log_softmax(model(input_ids=ids).logits[0].double(), -1)
    mask = answer_mask(example.span_ids)
    picked = [-float(logp[t - 1, example.input_ids[t]]) for t in range(1, len(example)) if mask[t]]
    return sum(picked) / len(picked)


def test_each_rows_answer_nll_is_its_own_forward_read_by_hand(rows, tmp_path):
    model_dir, examples, tok = rows
    base = load_causal_lm(str(model_dir)).eval()
    post = load_causal_lm(str(build_replica(FAMILY, tmp_path / "post", seed=1))).eval()
    figures = measure_domain(_pair(base, post), examples, variants(True), 3, pad_id_of(tok))
    assert list(figures) == [POST, REVERTED, BASE, REVERSED]
    for variant, model in ((POST, post), (BASE, base)):
        hand = [_hand_nll(model, e) for e in examples]
        assert figures[variant].nll_rows == pytest.approx(hand, rel=1e-5, abs=1e-6), variant
        assert figures[variant].answer_tokens == sum(sum(answer_mask(e.span_ids)) - 0 for e in examples)
    assert figures[BASE].summary()["topk_overlap"] == {"all": 1.0, "Q": 1.0, "A": 1.0}


def test_the_prompt_span_is_not_in_the_nll(rows):
    """A model whose prompt predictions alone differ would change nothing: the rows' figures read answer tokens."""
    model_dir, examples, tok = rows
    ex = examples[0]
    mask = answer_mask(ex.span_ids)
    assert any(s == SPAN_Q for s in ex.span_ids) and not any(
        m for m, s in zip(mask, ex.span_ids, strict=True) if s == SPAN_Q
    )
    base = load_causal_lm(str(model_dir)).eval()
    figures = measure_domain(_pair(base, base), [ex], (POST,), 1, pad_id_of(tok))
    with torch.no_grad():
        everything = torch.log_softmax(base(input_ids=torch.tensor([ex.input_ids])).logits[0].double(), -1)
    all_tokens = -sum(float(everything[t - 1, ex.input_ids[t]]) for t in range(1, len(ex))) / (len(ex) - 1)
    assert figures[POST].nll_rows[0] == pytest.approx(_hand_nll(base, ex), rel=1e-5)
    assert figures[POST].nll_rows[0] != pytest.approx(all_tokens, rel=1e-3)


def test_a_post_moved_only_in_its_routers_reverts_to_the_base_exactly_and_is_itself_after(rows):
    model_dir, examples, tok = rows
    base = load_causal_lm(str(model_dir)).eval()
    post = _moved_routers(base)
    before = {k: v.clone() for k, v in post.state_dict().items()}
    base_before = {k: v.clone() for k, v in base.state_dict().items()}
    figures = measure_domain(_pair(base, post), examples, variants(True), 4, pad_id_of(tok))
    assert figures[REVERTED].nll_rows == figures[BASE].nll_rows  # exactly: the same weights throughout
    assert figures[REVERTED].summary()["topk_overlap"] == {"all": 1.0, "Q": 1.0, "A": 1.0}
    assert figures[REVERSED].nll_rows == figures[POST].nll_rows
    assert figures[POST].nll_rows != figures[BASE].nll_rows
    assert figures[POST].summary()["topk_overlap"]["all"] < 1.0
    after = post.state_dict()
    assert all(torch.equal(after[k], before[k]) for k in before), "the post model is its own again"
    assert all(torch.equal(base.state_dict()[k], v) for k, v in base_before.items())


def test_the_overlap_is_the_routers_own_choices_compared_by_hand(rows):
    model_dir, examples, tok = rows
    base = load_causal_lm(str(model_dir)).eval()
    post = _moved_routers(base, scale=0.05)
    facts = get_adapter(base.config.model_type)
    figures = measure_domain(_pair(base, post), examples, (POST,), 3, pad_id_of(tok))  # padded batches
    got = figures[POST].summary()["topk_overlap_by_layer"]
    want = []
    for b_layer, p_layer in zip(find_moe_layers(base, facts), find_moe_layers(post, facts), strict=True):
        shared, count = 0.0, 0
        for e in examples:
            ids = torch.tensor([e.input_ids])
            chosen = []
            for model, layer in ((base, b_layer), (post, p_layer)):
                seen = {}  # the router's input; its logits and the family's rule by hand (tests/test_routing.py)
                hook = layer.router.register_forward_hook(lambda m, a, out, seen=seen: seen.__setitem__("h", a[0]))
                with torch.no_grad():
                    model(input_ids=ids)
                    hidden = seen["h"].reshape(len(e), -1)
                    logits = torch.nn.functional.linear(hidden.float(), layer.router.weight.float())
                    chosen.append(reference_route(layer.router, logits, torch.zeros_like(logits))[0])
                hook.remove()
            k = chosen[0].shape[1]
            shared += sum(len(set(a.tolist()) & set(b.tolist())) / k for a, b in zip(*chosen, strict=True))
            count += len(e)
        want.append(shared / count)
    assert got == pytest.approx(want, abs=1e-9)


def test_prompt_and_answer_cut_at_the_first_answer_run():
    from rpb.data import Example

    ex = Example(0, [1, 2, 3, 4, 5, 6, 7], [STRUCTURAL, SPAN_Q, STRUCTURAL, SPAN_A, SPAN_A, STRUCTURAL, STRUCTURAL])
    assert prompt_and_answer(ex) == ([1, 2, 3], [4, 5], 6)
    cut = Example(0, [1, 2, 3, 4], [SPAN_Q, STRUCTURAL, SPAN_A, SPAN_A])
    assert prompt_and_answer(cut) == ([1, 2], [3, 4], None)
    assert answer_budget([ex, cut]) == 3


def test_exact_match_is_greedy_decoding_of_each_prompt_alone(rows):
    model_dir, examples, tok = rows
    base = load_causal_lm(str(model_dir)).eval()
    pair = _pair(base, base)
    figures = measure_domain(pair, examples, (POST,), 8, pad_id_of(tok))
    # the model's own greedy continuation as the reference answer of half the rows: those must count as correct
    budget = 6
    hand, fixed = [], []
    for i, e in enumerate(examples):
        prompt, answer, stop = prompt_and_answer(e)
        with torch.no_grad():
            out = base.generate(torch.tensor([prompt]), max_new_tokens=budget, do_sample=False, eos_token_id=stop,
                                pad_token_id=pad_id_of(tok))[0, len(prompt):].tolist()  # fmt: skip
        cut = out[: out.index(stop)] if stop in out else out
        if i % 2 == 0 and cut:  # make this row's reference the model's own answer
            tokens = list(prompt) + cut + [stop]
            spans = e.span_ids[: len(prompt)] + [SPAN_A] * len(cut) + [STRUCTURAL]
            e = type(e)(e.index, tokens, spans)
            answer = cut
        fixed.append(e)
        hand.append(
            tok.decode(cut, skip_special_tokens=True).strip() == tok.decode(answer, skip_special_tokens=True).strip()
        )
    generate_domain(pair, tok, fixed, (POST,), figures, budget, 3, pad_id_of(tok))
    assert figures[POST].correct == hand and any(hand)
