"""Toy-world tasks: determinism, answers recomputed by independent parsers, disjoint splits, bounds."""

import hashlib
import random
import re
import string
from collections import Counter

import pytest

from rpb.toyworld.world.generators import POST_SETS
from rpb.toyworld.world.knowledge import FACT_ATTRIBUTES, knowledge_base
from rpb.toyworld.world.tasks import (
    DOMAINS,
    TRACE_SETS,
    Task,
    answer_budget,
    generate,
    is_correct,
    line_accuracy,
    mixture,
    question_space,
    sample,
    split_of,
    to_messages,
)

ALL = DOMAINS + POST_SETS
WITH_TRACES = ALL + TRACE_SETS
KB = knowledge_base(200)  # the larger world; the default (50 entities) is its prefix


# Independent solvers: parse the question text and recompute the answer with plain Python.


def _arith(q: str) -> str:
    m = re.fullmatch(r"(rev )?(\d+(?:[+-]\d+)+)=", q)
    assert m, q
    value = sum(int(term) for term in re.findall(r"[+-]?\d+", m[2]))  # "12+34-5" -> 12 + 34 - 5
    assert value >= 0, q
    return str(value)[::-1] if m[1] else str(value)


def _list_op(op: str, value):
    return {
        "sort": lambda xs: sorted(xs),
        "reverse": lambda xs: list(reversed(xs)),
        "max": max,
        "min": min,
        "len": len,
    }[op](value)


def _code(q: str) -> str:
    m = re.fullmatch(r"([a-z|]+) (\d(?: \d)*)", q)
    assert m, q
    value = [int(d) for d in m[2].split()]
    for op in m[1].split("|"):
        value = _list_op(op, value)
    return " ".join(str(d) for d in value) if isinstance(value, list) else str(value)


def _text(q: str) -> str:
    op, word = q.split(" ")
    assert re.fullmatch(r"[a-z]+", word), q
    return {
        "reverse": word[::-1],
        "upper": word.upper(),
        "first": word[:1],
        "last": word[-1:],
        "double": re.sub(r"(.)", r"\1\1", word),
    }[op]


def _fact_key(q: str) -> tuple[str, str]:
    words = re.findall(r"[A-Za-z]+", q)
    entities = [w for w in words if w in KB]
    attributes = [w for w in words if w in FACT_ATTRIBUTES]
    assert len(entities) == 1 and len(attributes) == 1, q
    return entities[0], attributes[0]


def _fact(q: str) -> str:
    entity, attribute = _fact_key(q)
    return KB[entity][attribute]


def _trace(q: str) -> str:
    """A running sum written out by hand: one line per term, partials modulo 10 (``sum%10``) or in full with
    their digits reversed (``rev sum``)."""
    m = re.fullmatch(r"(rev sum|sum%10) ((?:[a-g]\d ?)+)", q)
    assert m, q
    terms = m[2].split()
    assert [t[0] for t in terms] == list("abcdefg"[: len(terms)]), q
    lines, before = [], 0
    for term in terms:
        after = before + int(term[1])
        if m[1] == "sum%10":
            after %= 10
        lines.append(term[0] + " " + str(before)[::-1] + "+" + term[1] + "=" + str(after)[::-1])
        before = after
    return "\n".join(lines)


SOLVERS = {
    "math": _arith,
    "math_post": _arith,
    "code": _code,
    "code_post": _code,
    "text": _text,
    "facts": _fact,
    "sum_trace": _trace,
}


def _questions(tasks):
    return [t.question for t in tasks]


@pytest.mark.parametrize("domain", WITH_TRACES)
def test_same_seed_same_list_and_other_seeds_differ(domain):
    assert sample(domain, 50, seed=3) == sample(domain, 50, seed=3)
    assert sample(domain, 50, seed=3, split="heldout") == sample(domain, 50, seed=3, split="heldout")
    assert _questions(sample(domain, 50, seed=3)) != _questions(sample(domain, 50, seed=4))
    a, b = random.Random(9), random.Random(9)
    assert [generate(domain, a) for _ in range(20)] == [generate(domain, b) for _ in range(20)]


@pytest.mark.parametrize("domain", WITH_TRACES)
def test_answers_match_an_independent_evaluation(domain):
    tasks = sample(domain, 300, seed=0) + sample(domain, 100, seed=0, split="heldout")
    for task in tasks:
        assert task.domain == domain
        assert task.answer == SOLVERS[domain](task.question), task


def test_default_arithmetic_is_two_digit_operands_with_reversed_answers():
    for task in sample("math", 200, seed=1):
        m = re.fullmatch(r"rev (\d\d)\+(\d\d)=", task.question)
        assert m and m[1][0] != "0" and m[2][0] != "0", task
        assert task.answer == str(int(m[1]) + int(m[2]))[::-1]
    for task in sample("math_post", 200, seed=1):  # three-term sums: the post set's default
        assert re.fullmatch(r"rev \d\d\+\d\d\+\d\d=", task.question), task
    for task in sample("math_post", 200, seed=1, form="a+b-c"):
        assert re.fullmatch(r"rev \d\d\+\d\d-\d\d=", task.question), task
        assert task.answer == _arith(task.question)  # never negative
    with pytest.raises(ValueError, match="form"):
        sample("math_post", 1, seed=1, form="a*b")


def test_arithmetic_params():
    plain = sample("math", 100, seed=2, reverse=False)
    assert all(not t.question.startswith("rev") and t.answer == _arith(t.question) for t in plain)
    small = sample("math", 30, seed=2, digits=1)
    assert all(re.fullmatch(r"rev \d\+\d=", t.question) for t in small)
    both = sample("math", 300, seed=2, ops=("+", "-"))
    assert {"+", "-"} <= {ch for t in both for ch in t.question}
    assert all(t.answer == _arith(t.question) for t in both)  # differences are never negative
    assert question_space("math", digits=1) == 100
    assert question_space("math", ops=("+", "-")) == 90 * 90 + 90 * 91 // 2
    assert question_space("math_post") == 90**3
    brute = sum(1 for a in range(10) for b in range(10) for c in range(10) if a + b - c >= 0)
    assert question_space("math_post", digits=1, form="a+b-c") == brute
    with pytest.raises(ValueError, match="ops"):
        sample("math", 5, seed=0, ops=("*",))


def test_knowledge_base_is_fixed_and_named_uniquely():
    assert len(KB) == 200
    assert knowledge_base() == dict(list(KB.items())[:50])  # the default is the base recipe's 50 entities
    assert knowledge_base(50) == dict(list(KB.items())[:50])  # a smaller world is a prefix of a larger one
    names = list(KB) + [attrs[a] for attrs in KB.values() for a in ("capital", "language")]
    assert len(names) == len(set(names))
    assert all(set(attrs) == set(FACT_ATTRIBUTES) for attrs in KB.values())
    # Golden values: a changed world would silently invalidate every base model pretrained on the old one.
    assert next(iter(KB.items())) == ("Sogania", {"capital": "Detano", "language": "Suditese", "color": "red"})


def test_every_heldout_fact_phrasing_asks_a_fact_taught_in_train():
    train = sample("facts", 2400, seed=0, n_entities=200)  # all of it: 200 entities x 3 attributes x 4 phrasings
    held = sample("facts", 600, seed=0, split="heldout", n_entities=200)
    train_facts = Counter(_fact_key(t.question) for t in train)
    held_facts = Counter(_fact_key(t.question) for t in held)
    assert set(held_facts) == set(train_facts) and len(train_facts) == 600
    assert set(train_facts.values()) == {4} and set(held_facts.values()) == {1}
    with pytest.raises(ValueError, match="only 600 distinct heldout"):
        sample("facts", 601, seed=0, split="heldout", n_entities=200)


@pytest.mark.parametrize("domain", WITH_TRACES)
def test_train_and_heldout_never_overlap(domain):
    n_train, n_held = (600, 150) if domain == "facts" else (5000, 800)  # facts: all of the 50 default entities
    train = sample(domain, n_train, seed=0)
    held = sample(domain, n_held, seed=1, split="heldout")
    assert len(set(_questions(train))) == n_train and len(set(_questions(held))) == n_held
    assert not set(_questions(train)) & set(_questions(held))
    assert {split_of(t) for t in train} == {"train"} and {split_of(t) for t in held} == {"heldout"}


# Golden splits, computed once with the documented rule: held out iff the first 8 bytes of
# sha256(question, UTF-8), read big-endian, divided by 2**64, fall below 0.15. The unit value is noted
# beside each; the near-threshold ones (0.13-0.17) catch a moved threshold, the rest a changed hash.
GOLDEN_SPLITS = [
    ("math", "rev 47+85=", "train"),  # 0.4032 (the docs' examples, all training questions)
    ("code", "sort 3 1 2", "train"),  # 0.4167
    ("text", "upper kiw", "train"),  # 0.3208
    ("math_post", "rev 15+59+70=", "train"),  # 0.4228
    ("code_post", "sort|reverse 3 1 2", "train"),  # 0.5607
    ("sum_trace", "sum%10 a4 b7 c1 d9 e3", "train"),  # 0.9974
    ("math", "rev 95+99=", "heldout"),  # 0.0001
    ("code", "len 3 1 9 4 1", "heldout"),  # 0.0855
    ("text", "upper hcepr", "heldout"),  # 0.0811
    ("math_post", "rev 59+71+90=", "heldout"),  # 0.0930
    ("code_post", "reverse|reverse 7 4 3 0 7", "heldout"),  # 0.0691
    ("sum_trace", "sum%10 a0 b1 c0 d3 e8 f6", "heldout"),  # 0.0312
    ("code", "len 0 5 3 3 1 8", "heldout"),  # 0.1425
    ("text", "reverse tiu", "heldout"),  # 0.1339
    ("math_post", "rev 83+52+38=", "heldout"),  # 0.1463
    ("sum_trace", "sum%10 a1 b2 c4 d7 e3 f6", "heldout"),  # 0.1376
    ("code_post", "sort|len 7 8 3 6", "train"),  # 0.1506
    ("code", "max 9 7 4 3", "train"),  # 0.1596
    ("math_post", "rev 34+53+25=", "train"),  # 0.1618
    ("sum_trace", "sum%10 a7 b8 c7 d3 e3 f4 g2", "train"),  # 0.1652
]


def check_hashed_split_golden() -> None:
    got = [(d, q, split_of(Task(d, q, ""))) for d, q, _ in GOLDEN_SPLITS]
    assert got == GOLDEN_SPLITS


def test_hashed_split_is_the_documented_sha256_rule():
    check_hashed_split_golden()


@pytest.mark.parametrize("fraction", [0.14, 0.16, 0.2])
def test_mutant_moved_threshold_is_caught(fraction, monkeypatch):
    monkeypatch.setattr("rpb.toyworld.world.tasks.HELDOUT_FRACTION", fraction)
    with pytest.raises(AssertionError):
        check_hashed_split_golden()


def test_mutant_little_endian_hash_is_caught(monkeypatch):
    """The same sha256 bytes read the other way round: still uniform, still 15%, another split."""

    def little_endian(text: str) -> float:
        return int.from_bytes(hashlib.sha256(text.encode("utf-8")).digest()[:8], "little") / 2**64

    monkeypatch.setattr("rpb.toyworld.world.tasks.stable_unit", little_endian)
    with pytest.raises(AssertionError):
        check_hashed_split_golden()


@pytest.mark.parametrize("domain", ["math", "code", "text", "math_post", "code_post", "sum_trace"])
def test_about_the_documented_fraction_is_held_out(domain):
    rng = random.Random(0)
    fraction = sum(split_of(generate(domain, rng)) == "heldout" for _ in range(4000)) / 4000
    assert 0.12 < fraction < 0.18


@pytest.mark.parametrize("domain", ALL)
def test_printable_and_short(domain):
    for task in sample(domain, 500, seed=7) + sample(domain, 100, seed=7, split="heldout"):
        assert set(task.question + task.answer) <= set(string.printable)
        assert 0 < len(task.question) <= 40 and 0 < len(task.answer) <= 12, task
        assert task.answer == task.answer.strip()


def test_is_correct_ignores_surrounding_whitespace_only():
    task = Task("code", "sort 3 1 2", "1 2 3")
    assert is_correct(task, "1 2 3") and is_correct(task, "  1 2 3\n")
    for near in ("1 2 4", "1 2  3", "123", "1 2", "1 2 3 4", "3 2 1", "1 2 3.", ""):
        assert not is_correct(task, near), near
    assert not is_correct(Task("math", "rev 47+85=", "231"), "132")


def test_traces_are_five_to_seven_lines_and_fit_their_budgets():
    from rpb.testing.tokenizers import moonlight_tokenizer
    from rpb.toyworld.grids.cot import COT_POST
    from rpb.toyworld.world.base import encode_tasks

    tasks = sample("sum_trace", 2000, seed=7)
    assert {len(t.answer.split("\n")) for t in tasks} == {5, 6, 7}
    assert all(t.question.startswith("sum%10 ") for t in tasks)
    assert all(set(t.question + t.answer) <= set(string.printable) for t in tasks)
    assert question_space("sum_trace") == 10**5 + 10**6 + 10**7
    full = sample("sum_trace", 200, seed=7, modulus=None)
    assert all(t.answer == _trace(t.question) and t.question.startswith("rev sum ") for t in full)
    # the longest traces there are: seven 9s (in full, every partial after the first has two digits)
    tok = moonlight_tokenizer()
    for question, last in (("sum%10 a9 b9 c9 d9 e9 f9 g9", "g 4+9=3"), ("rev sum a9 b9 c9 d9 e9 f9 g9", "g 45+9=36")):
        longest = Task("sum_trace", question, _trace(question))
        assert longest.answer.split("\n")[-1] == last
        ((ids, labels),) = encode_tasks(tok, [longest])
        assert len(ids) <= COT_POST.max_seq_len  # nothing truncated
        answer_tokens = sum(label != -100 for label in labels)  # the answer and its end-of-turn token
        assert answer_tokens <= answer_budget("sum_trace")
    assert answer_budget("math") == 16 and all(len(tok(t.answer)["input_ids"]) < 16 for t in sample("math", 50, 0))
    with pytest.raises(ValueError, match="terms"):
        sample("sum_trace", 1, seed=0, terms=(4, 7))
    with pytest.raises(ValueError, match="modulus"):
        sample("sum_trace", 1, seed=0, modulus=1)


def test_a_trace_is_scored_on_its_final_line_and_line_by_line():
    task = Task("sum_trace", "sum%10 a4 b7 c1 d9 e3", "a 0+4=4\nb 4+7=1\nc 1+1=2\nd 2+9=1\ne 1+3=4")
    assert task.answer == _trace(task.question)
    assert is_correct(task, task.answer) and line_accuracy(task, task.answer) == 1.0
    assert is_correct(task, " e 1+3=4\n") and line_accuracy(task, "e 1+3=4") == 0.0  # the final line alone
    wrong_middle = "a 0+4=4\nb 4+7=2\nc 2+1=3\nd 2+9=1\ne 1+3=4"
    assert is_correct(task, wrong_middle) and line_accuracy(task, wrong_middle) == 3 / 5
    assert not is_correct(task, task.answer + "\nf 4+1=5")  # a line too many: the final line is wrong
    assert line_accuracy(task, task.answer + "\nf 4+1=5") == 1.0  # lines past the reference's are not counted
    assert not is_correct(task, "a 0+4=4\nb 4+7=1") and line_accuracy(task, "a 0+4=4\nb 4+7=1") == 2 / 5
    assert not is_correct(task, "e 1+3=5") and line_accuracy(task, "") == 0.0


def test_to_messages():
    task = Task("text", "upper abc", "ABC")
    exchange = [{"role": "user", "content": "upper abc"}, {"role": "assistant", "content": "ABC"}]
    assert to_messages(task, system=None) == exchange
    assert to_messages(task) == [{"role": "system", "content": ""}, *exchange]


def test_mixture_is_balanced_shuffled_deterministic_and_split_pure():
    tasks = mixture(402, seed=0)
    counts = Counter(t.domain for t in tasks)
    assert counts == {"math": 101, "code": 101, "text": 100, "facts": 100}
    assert tasks == mixture(402, seed=0) and tasks != mixture(402, seed=1)
    assert len({t.domain for t in tasks[:20]}) > 1  # not grouped by domain
    held = mixture(100, seed=0, domains=POST_SETS, split="heldout", params={"math_post": {"reverse": False}})
    assert {split_of(t) for t in held} == {"heldout"}
    assert not any(t.question.startswith("rev") for t in held if t.domain == "math_post")
    with pytest.raises(ValueError, match="not in the mixture"):
        mixture(10, seed=0, params={"math_post": {}})


def test_too_small_question_spaces_raise_clear_errors():
    assert question_space("facts") == 750  # 50 entities x 3 attributes x 5 phrasings
    assert question_space("facts", n_entities=200) == 3000
    with pytest.raises(ValueError, match="only 750 distinct questions"):
        sample("facts", 751, seed=0)
    with pytest.raises(ValueError, match=r"only \d+ distinct heldout questions"):
        sample("math", 2000, seed=0, split="heldout")  # ~15% of 8100
    tiny = {"ops": ("max",), "lengths": (2, 2)}  # 100 questions, about 85 of them in train
    assert len(sample("code", 60, seed=0, **tiny)) == 60
    with pytest.raises(ValueError, match="distinct train questions of code"):
        sample("code", 99, seed=0, **tiny)
    with pytest.raises(ValueError, match="unknown domain"):
        sample("poetry", 1, seed=0)
    with pytest.raises(ValueError, match="split"):
        sample("math", 1, seed=0, split="test")
