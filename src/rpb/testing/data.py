"""Small synthetic conversations for the embedded default run (seeded, deterministic)."""

from __future__ import annotations

import json
import random
from pathlib import Path


def _math(rng: random.Random) -> tuple[str, str]:
    a, b = rng.randint(10, 99), rng.randint(10, 99)
    return f"What is {a} + {b}?", f"{a} + {b} = {a + b}."


def _lists(rng: random.Random) -> tuple[str, str]:
    xs = [rng.randint(0, 9) for _ in range(rng.randint(3, 6))]
    return f"Sort the list {xs}.", f"Sorted: {sorted(xs)}."


def _text(rng: random.Random) -> tuple[str, str]:
    word = "".join(rng.choice("abcdefghij") for _ in range(rng.randint(3, 7)))
    return f"Reverse the word '{word}'.", f"'{word[::-1]}'"


GENERATORS = (_math, _lists, _text)


def conversations(n: int, seed: int = 0, multi_turn_every: int = 5) -> list[dict]:
    """``n`` rows in the messages form; every ``multi_turn_every``-th one has two exchanges."""
    rng = random.Random(seed)
    rows = []
    for i in range(n):
        messages = []
        for _ in range(2 if multi_turn_every and i % multi_turn_every == multi_turn_every - 1 else 1):
            q, a = rng.choice(GENERATORS)(rng)
            messages += [{"role": "user", "content": q}, {"role": "assistant", "content": a}]
        rows.append({"messages": messages})
    return rows


def long_conversations(rows: int, seed: int = 0) -> list[dict]:
    """Rows of 4 to 10 single exchanges each (about 200 to 550 tokens with the Moonlight template)."""
    rng = random.Random(seed)
    exchanges = iter(conversations(rows * 10, seed, multi_turn_every=0))
    return [
        {"messages": [m for _ in range(rng.randint(4, 10)) for m in next(exchanges)["messages"]]} for _ in range(rows)
    ]


def write_jsonl(rows: list[dict], path: str | Path) -> Path:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "w", encoding="utf-8") as f:
        for row in rows:
            f.write(json.dumps(row, ensure_ascii=False) + "\n")
    return path
