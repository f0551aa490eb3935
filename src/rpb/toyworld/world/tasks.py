"""Sampling the toy world's tasks (the domains' generators: ``rpb.toyworld.world.generators``), their train / held-out
split, and checking and formatting their answers.

Splits. ``split_of`` assigns a question to "train" or "heldout" as a function of its text
alone, so train and held-out never overlap whatever the seeds:

* math, code, text and the post sets: a sha256 of the question; 15% is held out. Held-out
  questions are new instances of a rule the model can learn.
* facts: a fact that pretraining never shows cannot be recalled, so "held out" here means a
  held-out *phrasing* of a fact that pretraining does teach. Each fact (entity, attribute) can be
  asked with five templates; a hash of the fact picks one of them as its held-out phrasing
  (exactly 20%) and the other four are training questions, so every fact is taught and every
  held-out question asks something the model has seen in other words.
"""

from __future__ import annotations

import hashlib
import random
from collections.abc import Sequence

from rpb.toyworld.world.generators import DOMAINS, TRACE_SETS, Task, domain_spec
from rpb.toyworld.world.knowledge import FACT_TEMPLATES, parse_fact

SPLITS = ("train", "heldout")

#: one step of a trace is one line (``rpb retention --steps-by``)
TRACE_STEPS = "\n"
HELDOUT_FRACTION = 0.15  # of each hashed domain's questions; facts hold out 1 of their 5 phrasings
_ENUMERATE_LIMIT = 100_000  # smaller spaces are listed in full, so sample() is exact and never stalls


def _check_split(split: str) -> None:
    if split not in SPLITS:
        raise ValueError(f"split must be one of {SPLITS}, got {split!r}")


def stable_unit(text: str) -> float:
    """A number in [0, 1) from sha256: the same in every process, unlike the salted built-in hash()."""
    return int.from_bytes(hashlib.sha256(text.encode("utf-8")).digest()[:8], "big") / 2**64


# --------------------------------------------------------------------------- public API


def generate(domain: str, rng: random.Random, **params) -> Task:
    """One task of ``domain`` drawn with ``rng``; ``params`` are the domain generator's keywords."""
    return domain_spec(domain).generate(rng, **params)


def question_space(domain: str, **params) -> int:
    """How many distinct questions ``domain`` has with ``params`` (both splits together)."""
    return domain_spec(domain).size(**params)


def split_of(task: Task) -> str:
    """ "train" or "heldout", a function of the question text only (see the module docstring)."""
    if task.domain == "facts":
        entity, attr, template = parse_fact(task.question)
        held = template == int(stable_unit(f"{entity}/{attr}") * len(FACT_TEMPLATES))
    else:
        held = stable_unit(task.question) < HELDOUT_FRACTION
    return "heldout" if held else "train"


def sample(domain: str, n: int, seed: int, split: str = "train", **params) -> list[Task]:
    """``n`` tasks with distinct questions, all from ``split``; the same list for the same arguments.

    Raises ``ValueError`` when the split has fewer than ``n`` distinct questions.
    """
    spec = domain_spec(domain)
    _check_split(split)
    size = spec.size(**params)
    if n > size:
        raise ValueError(f"{domain} has only {size} distinct questions with {params or 'default params'}, not {n}")
    rng = random.Random(f"{domain}:{seed}")  # a string seed is hashed with sha512: stable across processes

    if spec.enumerate is not None and size <= _ENUMERATE_LIMIT:
        pool = [t for t in spec.enumerate(**params) if split_of(t) == split]
        if n > len(pool):
            raise ValueError(f"{domain} has only {len(pool)} distinct {split} questions, not {n}")
        return rng.sample(pool, n)

    # Large spaces: draw, keep new questions of the split; give up only after a long run of misses.
    tasks, seen, misses, patience = [], set(), 0, 10_000 + 20 * n
    while len(tasks) < n:
        task = spec.generate(rng, **params)
        if task.question in seen or split_of(task) != split:
            misses += 1
            if misses > patience:
                raise ValueError(
                    f"found only {len(tasks)} distinct {split} questions of {domain} (of about "
                    f"{size} in both splits) after {patience} draws without a new one, not {n}"
                )
            continue
        seen.add(task.question)
        tasks.append(task)
        misses = 0
    return tasks


def mixture(
    n: int,
    seed: int,
    domains: Sequence[str] = DOMAINS,
    split: str = "train",
    params: dict[str, dict] | None = None,
) -> list[Task]:
    """``n`` tasks split evenly over ``domains`` (the first ``n % len(domains)`` get one more), shuffled.

    ``params`` maps a domain to its generator keywords, e.g. ``{"math": {"reverse": False}}``.
    """
    params = params or {}
    if not domains or len(set(domains)) != len(domains):
        raise ValueError(f"domains must be distinct and non-empty, got {tuple(domains)!r}")
    if unknown := set(params) - set(domains):
        raise ValueError(f"params given for domains not in the mixture: {sorted(unknown)}")
    k = len(domains)
    tasks = [
        task
        for i, domain in enumerate(domains)
        for task in sample(domain, n // k + (i < n % k), seed, split, **params.get(domain, {}))
    ]
    random.Random(f"mixture:{seed}").shuffle(tasks)
    return tasks


def answer_budget(domain: str) -> int:
    """How many tokens greedy decoding may generate for an answer of ``domain``."""
    return domain_spec(domain).new_tokens


def _lines(text: str) -> list[str]:
    return [line.strip() for line in text.strip().split("\n")]


def is_correct(task: Task, prediction: str) -> bool:
    """Exact match, ignoring whitespace around the prediction; a trace's final line against the reference's."""
    if task.domain in TRACE_SETS:
        return _lines(prediction)[-1] == _lines(task.answer)[-1]
    return prediction.strip() == task.answer


def line_accuracy(task: Task, prediction: str) -> float:
    """The fraction of the reference's lines that the prediction's line at the same place matches exactly
    (missing lines are wrong; lines past the reference's last are not counted)."""
    want, got = _lines(task.answer), _lines(prediction)
    return sum(i < len(got) and got[i] == line for i, line in enumerate(want)) / len(want)


def to_messages(task: Task, system: str | None = "") -> list[dict[str, str]]:
    """The task as a user/assistant exchange, ready for a chat template.

    ``system=""`` adds an empty system turn: Moonlight's template otherwise inserts its default
    system prompt, which would be about half of every toy sequence (structural tokens that only
    cost compute). ``None`` leaves the template's default in place.
    """
    turns = [{"role": "user", "content": task.question}, {"role": "assistant", "content": task.answer}]
    return turns if system is None else [{"role": "system", "content": system}, *turns]
