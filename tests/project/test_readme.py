"""The README as a newcomer reads it: what rpb is, the two commands within its first 25 lines, a quickstart on
a real model within 60, the full grid's forest plot within 90, at most about 120 lines in all, and no timing
history (timings live in docs/performance.md, one table by date and machine)."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
README = (ROOT / "README.md").read_text()
MAX_LINES = 125
FOREST = "docs/results/full/forest.svg"
#: what a timing history looks like: a duration in minutes or seconds, or a machine's core count with a time
TIMING = re.compile(r"\d[\d½.]* ?(?:min(?:utes?)?|hours?)\b|\d+(?:\.\d+)? ?s on \d+ cores?|\b\d+ tests in\b")


def first_line(lines: list[str], found) -> int:
    """1-based number of the first line for which ``found`` is true; 0 when none is."""
    return next((i for i, line in enumerate(lines, 1) if found(line)), 0)


def positions(text: str) -> dict[str, int]:
    """Where the reader meets each part: the lines of the two commands, the opening line of the first code
    block that names a real model (the quickstart), and the line that shows the forest plot."""
    lines = text.splitlines()
    fences = [i for i, line in enumerate(lines) if line.startswith("```")]
    blocks = [(a + 1, "\n".join(lines[a + 1 : b])) for a, b in zip(fences[::2], fences[1::2], strict=True)]
    real = [start for start, body in blocks if re.search(r"\b[\w-]+/[\w.-]+-\d+B\b", body)]
    return {
        "make demo": first_line(lines, lambda ln: ln.startswith("make demo")),
        "make test": first_line(lines, lambda ln: ln.startswith("make test")),
        "quickstart": real[0] if real else 0,
        "figure": first_line(lines, lambda ln: bool(re.search(rf"!\[[^\]]*\]\({re.escape(FOREST)}\)", ln))),
        "lines": len(lines),
    }


def timings(text: str) -> list[str]:
    return [m.group(0) for m in TIMING.finditer(text)]


def test_each_part_is_where_a_newcomer_meets_it():
    at = positions(README)
    assert 0 < at["make demo"] <= 25 and 0 < at["make test"] <= 25, at
    assert 0 < at["quickstart"] <= 60, at
    assert 0 < at["figure"] <= 90, at
    assert at["lines"] <= MAX_LINES, at


def test_the_quickstart_block_is_the_tested_one_and_its_python_imports_what_it_uses():
    """The first real-model block is the one tests/project/test_quickstart.py runs, and every name the
    README's Python snippet calls is imported in it."""
    lines = README.splitlines()
    assert lines[positions(README)["quickstart"] - 2].startswith("<!-- quickstart")
    (snippet,) = re.findall(r"^```python\n(.*?)^```", README, flags=re.S | re.M)
    imported = {
        n.strip() for names in re.findall(r"^from \S+ import (.+)$", snippet, flags=re.M) for n in names.split(",")
    }
    called = set(re.findall(r"\b([A-Za-z_]\w*)\(", snippet)) - {"train"}
    assert called - {"model", "tokenizer"} <= imported, called - imported


def test_no_timing_history():
    assert timings(README) == []


def test_the_readme_shows_the_full_grids_forest_plot():
    assert FOREST in README


@pytest.mark.parametrize(
    ("edit", "breaks"),
    [
        (lambda t: "\n" * 20 + t, "make demo"),
        (lambda t: t.replace("<!-- quickstart", "\n" * 40 + "<!-- quickstart", 1), "quickstart"),
        (lambda t: t.replace("![", "\n" * 40 + "![", 1), "figure"),
        (lambda t: t + "\nline" * 60, "lines"),
    ],
    ids=["commands", "quickstart", "figure", "length"],
)
def test_mutant_readme_part_pushed_down_is_caught(edit, breaks):
    limits = {"make demo": 25, "quickstart": 60, "figure": 90, "lines": MAX_LINES}
    assert positions(README)[breaks] <= limits[breaks] < positions(edit(README))[breaks]


@pytest.mark.parametrize(
    "history",
    ["`make test` about 7 to 9½ minutes", "909 tests in 10 min 38 s of pytest", "takes 4 min 32 s", "45 s on 2 cores"],
)
def test_mutant_timing_history_is_caught(history):
    assert timings(history) != []
