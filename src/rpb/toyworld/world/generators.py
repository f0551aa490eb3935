"""Seeded generators of short question/answer tasks, one per domain: the toy world's pretraining and post-training
data (``rpb.toyworld.world.tasks`` samples them, splits and checks them).

Every question is short (<= 40 characters with the defaults), every answer but a trace's is short (<= 12
characters) and checked by exact match, and only ``string.printable`` characters appear (the
character-level toy tokenizer's charset), so a tiny MoE transformer (hidden 128, 4 layers) can
learn all domains in minutes on a CPU.

=========  ==============================  ==============  ===========================================
domain     question                        answer          rule
=========  ==============================  ==============  ===========================================
math       ``rev 47+85=``                  ``231``         a+b of 2-digit numbers, digits reversed
code       ``sort 3 1 2``                  ``1 2 3``       sort / reverse / max / min / len, 3-6 digits
text       ``double kiw``                  ``kkiiww``      reverse / upper / first / last / double
facts      ``capital of Sogania?``         ``Detano``      recall from a fixed invented knowledge base
math_post  ``rev 47+85+36=``               ``861``         three-term sums a+b+c, digits reversed
code_post  ``sort|reverse 3 1 2``          ``3 2 1``       two-step pipelines of the code operations
sum_trace  ``sum%10 a4 b7 c1 d9 e3``       5-7 lines       a running sum mod 10, a line per partial (below)
=========  ==============================  ==============  ===========================================

``math_post`` and ``code_post`` play the roles of the paper's math20k and coding20k: same
domain and answer conventions as pretraining, shifted to harder compositions (a third term; a
second operation). ``math_post`` also has the form ``a+b-c`` (a subtraction step; ``form=``),
which small models learn far more slowly.

``sum_trace`` is the long-trace set (``TRACE_SETS``): a step-by-step answer of 5 to 7 lines, one
per term, each written out as ``<label> <partial so far>+<term>=<new partial>``, the partials taken
modulo 10 (``modulus``)::

    sum%10 a4 b7 c1 d9 e3   ->   a 0+4=4 / b 4+7=1 / c 1+1=2 / d 2+9=1 / e 1+3=4

(lines separated by newlines). Each line needs only the line before it and the term its label
names in the question: a copy, a lookup by label and the ones digit of a one-digit sum (the first
digit the math domain writes). Exact match (``tasks.is_correct``) scores the final line, which is right
only if every step was, and ``tasks.line_accuracy`` the trace line by line. Its answers (up to 55
characters) do not fit the short sets' generation budget or ``PostRecipe.max_seq_len``;
``tasks.answer_budget`` gives each set's generation length. ``modulus=None`` writes the full running sum
instead, every partial least-significant digit first (``rev sum a4 b7 ...`` -> ``a 0+4=4 / b 4+7=11
/ c 11+1=21 / ...``, up to 67 characters): in the pilot (500 steps of ``sft`` on base 0) it reached
0.4% final-line exact match and 32% of the lines, against the 30% the long-trace grid needs.

Digit order. Answers to arithmetic are written least-significant digit first by default
(``reverse=True``; the question says so with its ``rev`` prefix). A left-to-right decoder that
writes the most significant digit first must resolve every carry before its first output token;
written in reverse, each digit depends only on the two operand digits in that position and the
carry from the digit it has just written, a local rule that small transformers learn quickly and
apply to unseen operand pairs (Lee et al., 2023, "Teaching Arithmetic to Small Transformers").
``reverse=False`` writes the ordinary order; small operands (``digits=1``) are the other remedy.
"""

from __future__ import annotations

import random
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass

from rpb.toyworld.world.knowledge import FACT_ATTRIBUTES, FACT_TEMPLATES, N_ENTITIES, kb

DOMAINS = ("math", "code", "text", "facts")
POST_SETS = ("math_post", "code_post")
#: post-training sets whose answers are step-by-step traces, one step per line (see the docstring)
TRACE_SETS = ("sum_trace",)


@dataclass(frozen=True)
class Task:
    domain: str
    question: str
    answer: str


# --------------------------------------------------------------------------- arithmetic


def _operand_range(digits: int) -> tuple[int, int]:
    if digits < 1:
        raise ValueError(f"digits must be >= 1, got {digits}")
    return (0, 9) if digits == 1 else (10 ** (digits - 1), 10**digits - 1)


def _arith_task(domain: str, expr: str, value: int, reverse: bool) -> Task:
    if reverse:
        return Task(domain, f"rev {expr}=", str(value)[::-1])
    return Task(domain, f"{expr}=", str(value))


def _check_ops(ops: Sequence[str]) -> None:
    if not ops or len(set(ops)) != len(ops) or not set(ops) <= {"+", "-"}:
        raise ValueError(f"ops must be distinct items of ('+', '-'), got {ops!r}")


def _math(rng: random.Random, digits: int = 2, ops: Sequence[str] = ("+",), reverse: bool = True) -> Task:
    _check_ops(ops)
    lo, hi = _operand_range(digits)
    while True:  # redraw the whole triple, so that the valid ones are equally likely
        a, op, b = rng.randint(lo, hi), rng.choice(ops), rng.randint(lo, hi)
        if op == "+" or a >= b:  # differences stay non-negative
            return _arith_task("math", f"{a}{op}{b}", a + b if op == "+" else a - b, reverse)


def _math_all(digits: int = 2, ops: Sequence[str] = ("+",), reverse: bool = True) -> Iterator[Task]:
    _check_ops(ops)
    lo, hi = _operand_range(digits)
    for op in ops:
        for a in range(lo, hi + 1):
            for b in range(lo, hi + 1):
                if op == "+" or a >= b:
                    yield _arith_task("math", f"{a}{op}{b}", a + b if op == "+" else a - b, reverse)


def _math_size(digits: int = 2, ops: Sequence[str] = ("+",), reverse: bool = True) -> int:
    _check_ops(ops)
    lo, hi = _operand_range(digits)
    n = hi - lo + 1
    return sum(n * n if op == "+" else n * (n + 1) // 2 for op in ops)


MATH_POST_FORMS = ("a+b-c", "a+b+c")


def _math_post(rng: random.Random, digits: int = 2, form: str = "a+b+c", reverse: bool = True) -> Task:
    _check_names((form,), MATH_POST_FORMS, "form")
    lo, hi = _operand_range(digits)
    a, b = rng.randint(lo, hi), rng.randint(lo, hi)
    if form == "a+b+c":
        c = rng.randint(lo, hi)
        return _arith_task("math_post", f"{a}+{b}+{c}", a + b + c, reverse)
    c = rng.randint(lo, min(hi, a + b))  # a+b-c >= 0
    return _arith_task("math_post", f"{a}+{b}-{c}", a + b - c, reverse)


def _math_post_size(digits: int = 2, form: str = "a+b+c", reverse: bool = True) -> int:
    _check_names((form,), MATH_POST_FORMS, "form")
    lo, hi = _operand_range(digits)
    if form == "a+b+c":
        return (hi - lo + 1) ** 3
    # Group the (a, b) pairs by their sum s: min(s - 2lo, 2hi - s) + 1 pairs, each with min(hi, s) - lo + 1 c's.
    return sum((min(s - 2 * lo, 2 * hi - s) + 1) * (min(hi, s) - lo + 1) for s in range(2 * lo, 2 * hi + 1))


# --------------------------------------------------------------------------- code: list operations

#: Operations on a short list of single digits; the first two return lists, the rest numbers.
LIST_OPS: dict[str, Callable[[list[int]], list[int] | int]] = {
    "sort": sorted,
    "reverse": lambda xs: xs[::-1],
    "max": max,
    "min": min,
    "len": len,
}
CODE_OPS = tuple(LIST_OPS)
#: code_post: a list-to-list step, then any operation ("sort|reverse" sorts descending).
CODE_POST_PIPELINES = tuple(f"{a}|{b}" for a in ("sort", "reverse") for b in CODE_OPS)


def _show(value: list[int] | int) -> str:
    return " ".join(map(str, value)) if isinstance(value, list) else str(value)


def _check_lengths(lengths: tuple[int, int]) -> None:
    lo, hi = lengths
    if not 1 <= lo <= hi:
        raise ValueError(f"lengths must be (lo, hi) with 1 <= lo <= hi, got {lengths!r}")


def _check_names(names: Sequence[str], known: Sequence[str], what: str) -> None:
    if not names or len(set(names)) != len(names) or set(names) - set(known):
        raise ValueError(f"{what} must be distinct items of {tuple(known)}, got {tuple(names)!r}")


def _digits(rng: random.Random, lengths: tuple[int, int]) -> list[int]:
    return [rng.randint(0, 9) for _ in range(rng.randint(*lengths))]


def _code(rng: random.Random, ops: Sequence[str] = CODE_OPS, lengths: tuple[int, int] = (3, 6)) -> Task:
    _check_names(ops, CODE_OPS, "ops")
    _check_lengths(lengths)
    op, xs = rng.choice(ops), _digits(rng, lengths)
    return Task("code", f"{op} {_show(xs)}", _show(LIST_OPS[op](xs)))


def _code_post(
    rng: random.Random, pipelines: Sequence[str] = CODE_POST_PIPELINES, lengths: tuple[int, int] = (3, 6)
) -> Task:
    _check_names(pipelines, CODE_POST_PIPELINES, "pipelines")
    _check_lengths(lengths)
    pipeline, xs = rng.choice(pipelines), _digits(rng, lengths)
    first, then = pipeline.split("|")
    return Task("code_post", f"{pipeline} {_show(xs)}", _show(LIST_OPS[then](LIST_OPS[first](xs))))


def _lists_size(n_ops: int, lengths: tuple[int, int], alphabet: int) -> int:
    _check_lengths(lengths)
    return n_ops * sum(alphabet**k for k in range(lengths[0], lengths[1] + 1))


# --------------------------------------------------------------------------- traces: a running sum, line by line

_TRACE_LABELS = "abcdefg"  # one label per term; 7 terms at most


def _check_terms(terms: tuple[int, int]) -> None:
    lo, hi = terms
    if not 5 <= lo <= hi <= len(_TRACE_LABELS):
        raise ValueError(f"terms must be (lo, hi) with 5 <= lo <= hi <= {len(_TRACE_LABELS)}, got {terms!r}")


def _sum_trace(rng: random.Random, terms: tuple[int, int] = (5, 7), modulus: int | None = 10) -> Task:
    _check_terms(terms)
    if modulus is not None and modulus < 2:
        raise ValueError(f"modulus must be None (the full sum) or >= 2, got {modulus!r}")
    xs = _digits(rng, terms)
    prefix = "rev sum" if modulus is None else f"sum%{modulus}"
    question = prefix + " " + " ".join(f"{label}{x}" for label, x in zip(_TRACE_LABELS, xs, strict=False))
    lines, total = [], 0
    for label, x in zip(_TRACE_LABELS, xs, strict=False):  # xs has at most 7 terms
        after = total + x if modulus is None else (total + x) % modulus
        lines.append(f"{label} {str(total)[::-1]}+{x}={str(after)[::-1]}")
        total = after
    return Task("sum_trace", question, "\n".join(lines))


def _sum_trace_size(terms: tuple[int, int] = (5, 7), modulus: int | None = 10) -> int:
    _check_terms(terms)
    return sum(10**k for k in range(terms[0], terms[1] + 1))


# --------------------------------------------------------------------------- text: string transforms

TEXT_OPS: dict[str, Callable[[str], str]] = {
    "reverse": lambda w: w[::-1],
    "upper": str.upper,
    "first": lambda w: w[0],
    "last": lambda w: w[-1],
    "double": lambda w: "".join(ch + ch for ch in w),
}
_LETTERS = "abcdefghijklmnopqrstuvwxyz"


def _text(rng: random.Random, ops: Sequence[str] = tuple(TEXT_OPS), lengths: tuple[int, int] = (3, 6)) -> Task:
    _check_names(ops, tuple(TEXT_OPS), "ops")
    _check_lengths(lengths)
    op = rng.choice(ops)
    word = "".join(rng.choice(_LETTERS) for _ in range(rng.randint(*lengths)))
    return Task("text", f"{op} {word}", TEXT_OPS[op](word))


# --------------------------------------------------------------------------- facts: an invented world


def _fact_task(entity: str, attrs: dict[str, str], attr: str, template: int) -> Task:
    return Task("facts", FACT_TEMPLATES[template].format(attr=attr, ent=entity), attrs[attr])


def _facts(rng: random.Random, n_entities: int = N_ENTITIES) -> Task:
    entity, attrs = rng.choice(kb(n_entities))
    return _fact_task(entity, attrs, rng.choice(FACT_ATTRIBUTES), rng.randrange(len(FACT_TEMPLATES)))


def _facts_all(n_entities: int = N_ENTITIES) -> Iterator[Task]:
    for entity, attrs in kb(n_entities):
        for attr in FACT_ATTRIBUTES:
            for template in range(len(FACT_TEMPLATES)):
                yield _fact_task(entity, attrs, attr, template)


# --------------------------------------------------------------------------- registry


@dataclass(frozen=True)
class DomainSpec:
    generate: Callable[..., Task]
    size: Callable[..., int]  # the number of distinct questions for the given params
    enumerate: Callable[..., Iterator[Task]] | None = None  # only where generate is uniform over it
    new_tokens: int = 16  # greedy decoding's budget: the longest answer and its end-of-turn token fit


_REGISTRY: dict[str, DomainSpec] = {
    "math": DomainSpec(_math, _math_size, _math_all),
    "code": DomainSpec(_code, lambda ops=CODE_OPS, lengths=(3, 6): _lists_size(len(ops), lengths, 10)),
    "text": DomainSpec(_text, lambda ops=tuple(TEXT_OPS), lengths=(3, 6): _lists_size(len(ops), lengths, 26)),
    "facts": DomainSpec(
        _facts, lambda n_entities=N_ENTITIES: n_entities * len(FACT_ATTRIBUTES) * len(FACT_TEMPLATES), _facts_all
    ),
    "math_post": DomainSpec(_math_post, _math_post_size),
    "code_post": DomainSpec(
        _code_post, lambda pipelines=CODE_POST_PIPELINES, lengths=(3, 6): _lists_size(len(pipelines), lengths, 10)
    ),
    "sum_trace": DomainSpec(_sum_trace, _sum_trace_size, new_tokens=80),  # a full-sum trace has 67 characters
}


def domain_spec(domain: str) -> DomainSpec:
    """The generator, size, enumeration and answer budget of ``domain``."""
    if domain not in _REGISTRY:
        raise ValueError(f"unknown domain {domain!r}; choose one of {DOMAINS + POST_SETS + TRACE_SETS}")
    return _REGISTRY[domain]
