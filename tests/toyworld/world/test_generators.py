"""The domains' generators: question spaces counted by hand, and tasks worked out by hand."""

from __future__ import annotations

import random

import pytest

from rpb.toyworld.world.generators import (
    CODE_POST_PIPELINES,
    LIST_OPS,
    TEXT_OPS,
    domain_spec,
)


def test_question_spaces_counted_by_hand():
    assert domain_spec("math").size() == 90 * 90  # two-digit a+b
    assert domain_spec("math").size(digits=1, ops=("+", "-")) == 100 + 55  # a-b needs a >= b: 10*11/2 pairs
    assert domain_spec("math_post").size(digits=1) == 1000
    # a+b-c with one digit: the 1000 triples less those with c > a+b, (s+1)(9-s) for each a+b = s < 9: 165
    assert domain_spec("math_post").size(digits=1, form="a+b-c") == 1000 - 165
    brute = sum(c <= a + b for a in range(10) for b in range(10) for c in range(10))
    assert domain_spec("math_post").size(digits=1, form="a+b-c") == brute
    assert domain_spec("code").size(lengths=(1, 2)) == 5 * (10 + 100)
    assert domain_spec("text").size(ops=("upper",), lengths=(2, 2)) == 26 * 26
    assert domain_spec("sum_trace").size(terms=(5, 5)) == 10**5
    assert len(CODE_POST_PIPELINES) == 2 * 5


def test_the_enumerated_spaces_match_their_sizes():
    tasks = list(domain_spec("math").enumerate(digits=1, ops=("-",)))
    assert len(tasks) == 55 and len({t.question for t in tasks}) == 55
    assert tasks[0].question == "rev 0-0=" and tasks[-1].question == "rev 9-9="


def test_operations_on_hand_examples():
    assert LIST_OPS["sort"]([3, 1, 2]) == [1, 2, 3]
    assert LIST_OPS["reverse"]([3, 1, 2]) == [2, 1, 3]
    assert (LIST_OPS["max"]([3, 1, 2]), LIST_OPS["min"]([3, 1, 2]), LIST_OPS["len"]([3, 1, 2])) == (3, 1, 3)
    assert TEXT_OPS["double"]("kiw") == "kkiiww"
    assert (TEXT_OPS["first"]("kiw"), TEXT_OPS["last"]("kiw"), TEXT_OPS["upper"]("kiw")) == ("k", "w", "KIW")


@pytest.mark.parametrize("seed", range(20))
def test_generated_answers_follow_their_rules(seed):
    rng = random.Random(seed)
    math = domain_spec("math").generate(rng, reverse=False)
    a, b = math.question.removesuffix("=").split("+")
    assert math.answer == str(int(a) + int(b))
    post = domain_spec("math_post").generate(rng)
    a, b, c = post.question.removeprefix("rev ").removesuffix("=").split("+")
    assert post.answer == str(int(a) + int(b) + int(c))[::-1]
    code = domain_spec("code_post").generate(rng)
    pipeline, *digits = code.question.split()
    want = (
        sorted(digits, reverse=pipeline.startswith("sort|reverse"))
        if pipeline in ("sort|sort", "sort|reverse")
        else None
    )
    if want is not None:
        assert code.answer == " ".join(want)


def test_a_trace_by_hand():
    class Fixed(random.Random):
        """Draws 5 terms, then 4, 7, 1, 9, 3."""

        def __init__(self):
            super().__init__(0)
            self.draws = iter([5, 4, 7, 1, 9, 3])

        def randint(self, a, b):
            return next(self.draws)

    task = domain_spec("sum_trace").generate(Fixed())
    assert task.question == "sum%10 a4 b7 c1 d9 e3"
    assert task.answer == "a 0+4=4\nb 4+7=1\nc 1+1=2\nd 2+9=1\ne 1+3=4"
    full = domain_spec("sum_trace").generate(Fixed(), modulus=None)
    assert full.question == "rev sum a4 b7 c1 d9 e3"
    assert full.answer == "a 0+4=4\nb 4+7=11\nc 11+1=21\nd 21+9=12\ne 12+3=42"  # partials 4, 11, 12, 21, 24 reversed


def test_answer_budgets_and_unknown_domains():
    assert domain_spec("sum_trace").new_tokens == 80 and domain_spec("math").new_tokens == 16
    with pytest.raises(ValueError, match="unknown domain 'poetry'"):
        domain_spec("poetry")
    with pytest.raises(ValueError, match="ops must be distinct"):
        domain_spec("math").generate(random.Random(0), ops=("*",))
