"""``make test``'s two workers: each file runs whole on one worker, and the files that share a costly session fixture
run on the same one (tests/conftest.py), so that the fixture is built once a run."""

from __future__ import annotations

import ast
from pathlib import Path

from tests.conftest import SHARED_FIXTURES, SLOW_FIRST, xdist_group_of

TESTS = Path(__file__).resolve().parents[1]


def fixture_users(name: str) -> set[str]:
    """The test files (relative to tests/) with a test or fixture that takes ``name`` as an argument."""
    found = set()
    for path in TESTS.rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
            if isinstance(node, ast.FunctionDef) and any(a.arg == name for a in node.args.args):
                found.add(path.relative_to(TESTS).as_posix())
    return found - {"toyworld/conftest.py"}  # where the fixtures are made


def test_every_file_that_takes_a_shared_fixture_is_in_its_group():
    for name, files in SHARED_FIXTURES.items():
        assert fixture_users(name) == set(files), name


def test_a_file_is_its_own_group_unless_it_shares_a_fixture():
    assert xdist_group_of(TESTS / "prior/test_math.py") == "prior/test_math.py"
    assert xdist_group_of(TESTS / "toyworld" / "study" / "test_rl_report.py") == "rl_finished"
    assert xdist_group_of(TESTS / "toyworld" / "grids" / "test_revert_report.py") == "revert_finished"


def test_make_tests_scheduler_sends_each_group_whole_to_one_worker():
    from types import SimpleNamespace

    from tests.conftest import pytest_xdist_make_scheduler, scope_of

    assert scope_of("tests/toyworld/study/test_rl_report.py::test_a[x]") == "rl_finished"
    assert (
        scope_of("tests/prior/test_math.py::test_a")
        == scope_of("tests/prior/test_math.py::test_b")
        == "prior/test_math.py"
    )
    options = {"dist": "loadfile", "tx": ["2*popen"]}
    config = SimpleNamespace(getvalue=options.get, option=SimpleNamespace(loadscopereorder=True))
    scheduler = pytest_xdist_make_scheduler(config, None)
    assert scheduler.numnodes == 2
    assert scheduler._split_scope("tests/toyworld/grids/test_revert_study.py::test_a") == "revert_finished"
    assert pytest_xdist_make_scheduler(SimpleNamespace(getvalue={"dist": "load"}.get), None) is None


def test_each_unit_started_first_is_still_a_unit():
    units = {xdist_group_of(path) for path in TESTS.rglob("test_*.py")}
    assert len(set(SLOW_FIRST)) == len(SLOW_FIRST) and set(SLOW_FIRST) <= units, set(SLOW_FIRST) - units
