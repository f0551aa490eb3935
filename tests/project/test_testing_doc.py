"""docs/testing.md's table of named mutants is the suite's: every ``test_mutant_*`` defined under tests/ is
listed, every listed one exists, and each lives beside a check in a file that the table names."""

from __future__ import annotations

import ast
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
DOC = ROOT / "docs" / "testing.md"


def defined_mutants() -> dict[str, str]:
    """name -> test file (relative to the root) of every ``test_mutant_*`` function under tests/."""
    found = {}
    for path in sorted((ROOT / "tests").rglob("test_*.py")):
        for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
            if isinstance(node, ast.FunctionDef) and node.name.startswith("test_mutant_"):
                found[node.name] = str(path.relative_to(ROOT))
    return found


def listed_mutants() -> list[tuple[str, set[str]]]:
    """(mutant, the test files its table row names, or the nearest row above that names one) per row."""
    rows, files = [], set()
    for line in DOC.read_text().splitlines():
        names = re.findall(r"`(test_mutant_\w+)`", line)
        if not names:
            continue
        files = set(re.findall(r"`(tests/[\w/]+\.py)`", line)) or files
        rows += [(name, files) for name in names]
    return rows


def test_every_mutant_is_listed_once_with_its_file():
    defined, listed = defined_mutants(), listed_mutants()
    names = [name for name, _ in listed]
    assert sorted(set(names)) == sorted(names), "a mutant listed twice"
    assert sorted(defined) == sorted(names), "docs/testing.md and tests/ name different mutants"
    for name, files in listed:
        assert defined[name] in files, f"{name} is in {defined[name]}, the table says {sorted(files)}"


def test_the_reader_sees_a_missing_or_stale_row(tmp_path, monkeypatch):
    page = tmp_path / "testing.md"
    page.write_text("| check (`tests/test_x.py`) | bug | `test_mutant_gone_is_caught` |\n")
    monkeypatch.setattr(f"{__name__}.DOC", page)
    assert listed_mutants() == [("test_mutant_gone_is_caught", {"tests/test_x.py"})]
    assert "test_mutant_gone_is_caught" not in defined_mutants()
