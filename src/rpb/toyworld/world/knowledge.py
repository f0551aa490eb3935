"""The facts domain's invented world: a knowledge base of entities with a capital, a language and a colour,
and the five phrasings a fact can be asked in. It depends on ``KB_SEED`` alone, never on the seed of a
sample or a split, and a smaller world is a prefix of a larger one.
"""

from __future__ import annotations

import random
import re
from collections.abc import Callable
from functools import lru_cache

#: The knowledge base depends on this seed only, never on the seed of a sample or a split.
KB_SEED = 20260912
#: entities in the knowledge base (3 facts each), the toy world's base recipe's size: 50 entities were
#: learnt in 10 minutes of pretraining on 2 cores, 200 were not (see ``BaseRecipe.facts_entities``)
N_ENTITIES = 50
FACT_ATTRIBUTES = ("capital", "language", "color")
_COLORS = ("red", "blue", "green", "gold", "black", "white", "purple", "orange")
FACT_TEMPLATES = (
    "{attr} of {ent}?",
    "{ent}'s {attr}?",
    "What is {ent}'s {attr}?",
    "Tell me the {attr} of {ent}.",
    "{ent}: {attr}?",
)
# Each template as a regex, to read (entity, attribute, template) back from a question.
_TEMPLATE_RES = tuple(
    re.compile(
        re.escape(t)
        .replace(re.escape("{attr}"), "(?P<attr>[a-z]+)")
        .replace(re.escape("{ent}"), "(?P<ent>[A-Z][a-z]+)")
    )
    for t in FACT_TEMPLATES
)


def _syllables(rng: random.Random, k: int) -> str:
    return "".join(rng.choice("bdfgklmnprstvz") + rng.choice("aeiou") for _ in range(k))


@lru_cache(maxsize=8)
def kb(n_entities: int) -> tuple[tuple[str, dict[str, str]], ...]:
    if n_entities < 1:
        raise ValueError(f"n_entities must be >= 1, got {n_entities}")
    rng, used = random.Random(KB_SEED), set()

    def fresh(make: Callable[[], str]) -> str:  # every name in the world is distinct
        while (name := make().capitalize()) in used:
            pass
        used.add(name)
        return name

    rows = []
    # Entities are drawn one after another from one stream, so a smaller world is a prefix of a larger one.
    for _ in range(n_entities):
        entity = fresh(lambda: _syllables(rng, rng.randint(2, 3)) + rng.choice(("nia", "ria", "dor", "land", "mar")))
        capital = fresh(lambda: _syllables(rng, rng.randint(2, 3)) + rng.choice(("", "n", "l", "s")))
        language = fresh(lambda: _syllables(rng, 2) + rng.choice("nlrst") + rng.choice(("ish", "ese", "ic")))
        rows.append((entity, {"capital": capital, "language": language, "color": rng.choice(_COLORS)}))
    return tuple(rows)


def knowledge_base(n_entities: int = N_ENTITIES) -> dict[str, dict[str, str]]:
    """entity -> {attribute: value}, the same on every call and every machine."""
    return {entity: dict(attrs) for entity, attrs in kb(n_entities)}


def parse_fact(question: str) -> tuple[str, str, int]:
    for template, pattern in enumerate(_TEMPLATE_RES):
        if (m := pattern.fullmatch(question)) and m["attr"] in FACT_ATTRIBUTES:
            return m["ent"], m["attr"], template
    raise ValueError(f"not a facts question in any known template: {question!r}")
