"""``# fmt: skip`` in src/ only where a comment says why: the formatter owns every other line.

A skipped statement is a table of data that reads better aligned; the comment block right above the statement
says so, and names ``fmt: skip`` so that the reason and the marker are found together.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

SRC = Path(__file__).resolve().parents[2] / "src" / "rpb"
MARK = "# fmt: skip"
#: files whose bytes may not change, with the reason (a comment in them would change them too)
FROZEN = {
    "calibrate/rule.py": "the pre-registered calibration rule: its sha256 is pinned by tests/calibrate/test_rule.py "
    "and recorded in every calibrate.json, so not even a comment may be added",
}


def unexplained_skips(root: Path) -> list[str]:
    """``file:line`` of each skipped statement whose comment block above does not mention ``fmt: skip``."""
    found = []
    for path in sorted(root.rglob("*.py")):
        rel = path.relative_to(root).as_posix()
        text = path.read_text()
        if MARK not in text or rel in FROZEN:
            continue
        lines = text.splitlines()
        spans = [(n.lineno, n.end_lineno) for n in ast.walk(ast.parse(text)) if isinstance(n, ast.stmt)]
        for number, line in enumerate(lines, start=1):
            if not line.rstrip().endswith(MARK):
                continue
            # the innermost statement holding the marked line (a `for` header's line lies inside the loop)
            start = max((a for a, b in spans if a <= number <= b), default=number)
            above, i = [], start - 2
            while i >= 0 and lines[i].lstrip().startswith("#"):
                above.append(lines[i])
                i -= 1
            if not any("fmt: skip" in c for c in above):
                found.append(f"{rel}:{number}")
    return found


def test_every_fmt_skip_in_src_says_why():
    assert unexplained_skips(SRC) == []


def test_frozen_files_exist():
    assert all((SRC / rel).is_file() for rel in FROZEN)


@pytest.mark.parametrize(
    ("source", "caught"),
    [
        ("x = f(a,\n      b)  # fmt: skip\n", True),  # a wrapped call squeezed by hand
        ("# a table of data (fmt: skip below)\nT = {1: 2,\n     3: 4}  # fmt: skip\n", False),
        ("# fmt: skip below: aligned\n\ny = 1\nT = (1,\n     2)  # fmt: skip\n", True),  # the comment is elsewhere
    ],
)
def test_the_reader_catches_an_unexplained_skip(tmp_path, source, caught):
    (tmp_path / "mod.py").write_text(source)
    assert bool(unexplained_skips(tmp_path)) is caught
