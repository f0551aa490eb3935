"""The shape of the house, read from the source: what may import what, file sizes, and tests that mirror src/.

Imports are read with ``ast`` (every ``import`` and ``from ... import``, at any depth, lazy ones
included), so a rule cannot be dodged by importing inside a function.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
SRC = ROOT / "src" / "rpb"
TESTS = ROOT / "tests"
MAX_LINES = 450


def source_files() -> list[Path]:
    return sorted(p for p in SRC.rglob("*.py") if "egg-info" not in str(p))


def module_name(path: Path) -> str:
    parts = path.relative_to(SRC.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def imported_modules(path: Path) -> set[str]:
    """Every module ``path`` imports, absolute (relative imports resolved against its package)."""
    tree = ast.parse(path.read_text(), filename=str(path))
    package = module_name(path) if path.name == "__init__.py" else module_name(path).rpartition(".")[0]
    out = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            out |= {a.name for a in node.names}
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join([*anchor, base] if base else anchor)
            out.add(base)
            out |= {f"{base}.{a.name}" for a in node.names}
    return out


def test_the_module_reader_sees_lazy_and_relative_imports(tmp_path, monkeypatch):
    pkg = tmp_path / "rpb" / "sub"
    pkg.mkdir(parents=True)
    (pkg / "mod.py").write_text("import os\ndef f():\n    from rpb.toyworld import tasks\n    from . import sibling\n")
    monkeypatch.setattr(f"{__name__}.SRC", tmp_path / "rpb")
    assert imported_modules(pkg / "mod.py") >= {"os", "rpb.toyworld", "rpb.toyworld.tasks", "rpb.sub.sibling"}


@pytest.mark.parametrize("name", ["prior.py", "routing.py"])
def test_pure_math_imports_nothing_from_rpb(name):
    found = sorted(m for m in imported_modules(SRC / name) if m == "rpb" or m.startswith("rpb."))
    assert found == [], f"{name} imports {found}"


def test_only_the_command_line_imports_the_toy_world():
    offenders = [
        module_name(p)
        for p in source_files()
        if p != SRC / "cli.py"
        and not p.is_relative_to(SRC / "toyworld")
        and any(m == "rpb.toyworld" or m.startswith("rpb.toyworld.") for m in imported_modules(p))
    ]
    assert offenders == []


def test_nothing_in_src_imports_the_tests():
    offenders = [module_name(p) for p in source_files() if any(m.split(".")[0] == "tests" for m in imported_modules(p))]
    assert offenders == []


def test_no_source_file_is_longer_than_one_sitting():
    long = {str(p.relative_to(SRC)): n for p in source_files() if (n := len(p.read_text().splitlines())) > MAX_LINES}
    assert long == {}


def test_tests_mirror_src():
    """tests/a/b/test_x.py tests src/rpb/a/b/x.py (or x/, or x.py under a longer name test_x_more.py);
    tests/project/ holds what belongs to the whole project (docs, structure, the quickstart)."""
    orphans = []
    for test in sorted(TESTS.rglob("test_*.py")):
        rel = test.relative_to(TESTS)
        if rel.parts[0] == "project":
            continue
        folder = SRC.joinpath(*rel.parts[:-1])
        stem = rel.stem.removeprefix("test_")
        words = stem.split("_")
        candidates = ["_".join(words[:i]) for i in range(len(words), 0, -1)]
        if not any((folder / f"{c}.py").is_file() or (folder / c / "__init__.py").is_file() for c in candidates):
            orphans.append(str(rel))
    assert orphans == []


def test_every_source_module_has_tests_or_is_covered_through_its_package():
    """Each module of src/ has a test file of its own, or its package folder has tests (the small
    helpers such as ``context.py`` are exercised through their package's tests)."""
    untested = []
    for path in source_files():
        rel = path.relative_to(SRC)
        folder = TESTS.joinpath(*rel.parts[:-1])
        if path.name in ("__init__.py", "__main__.py"):
            continue
        own = list(folder.glob(f"test_{path.stem}.py")) + list(folder.glob(f"test_{path.stem}_*.py"))
        if not own and not list(folder.glob("test_*.py")):
            untested.append(str(rel))
    assert untested == []
