"""Apply each mutant to a scratch copy of the repository and run the tests that must catch it.

A mutant is anchored: a regular expression that must match exactly once inside one named function (found
with ``ast``), so an unrelated edit elsewhere in the file does not break it, and a mutation that no longer
applies is a harness error, never "killed". Each run is a fresh ``pytest`` process whose ``rpb`` must be the
scratch copy's (``guard.py``). Outcomes:

* ``killed``: a listed test failed on an assertion (``AssertionError``, or pytest's own ``Failed``);
* ``survived``: every listed test passed;
* ``error``: anything else (the mutation does not apply, import or collection broke, a test raised another
  exception, the timeout) -- a harness error, to be fixed in the catalogue.

The runs are forked from one warm process that has imported the heavy libraries but no ``rpb`` (``forks.py``).
"""

from __future__ import annotations

import ast
import os
import re
import shutil
import tempfile
import time
import xml.etree.ElementTree as ET
from dataclasses import dataclass
from pathlib import Path

from tests.mutants.forks import WarmPytest
from tests.mutants.guard import GUARD_EXIT

ROOT = Path(__file__).resolve().parents[2]
_SKIP = shutil.ignore_patterns(".venv", ".git", "__pycache__", ".pytest_cache", ".ruff_cache", "rpb-demo",
                               "*.egg-info", "build", "dist")  # fmt: skip
#: failure types that count as a kill: the test's own assertion
_ASSERTIONS = ("AssertionError", "Failed")


@dataclass(frozen=True)
class Mutant:
    name: str
    #: the realistic bug, in one line
    story: str
    #: the mutated file, relative to src/rpb
    path: str
    #: the function the mutation lies in: "name" or "Class.method"
    function: str
    #: a regular expression matching exactly once inside that function, and what replaces it
    pattern: str
    replacement: str
    #: pytest node ids (relative to the repository) that must catch it
    tests: tuple[str, ...]
    #: run by `make test` under CI=true
    ci: bool = False


class MutationError(Exception):
    """The mutation cannot be applied as written (a harness error)."""


def _function_span(tree: ast.Module, qualname: str) -> tuple[int, int]:
    nodes: list = [tree]
    for part in qualname.split("."):
        found = [
            n for parent in nodes for n in ast.iter_child_nodes(parent)
            if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)) and n.name == part
        ]  # fmt: skip
        if len(found) != 1:
            raise MutationError(f"{qualname}: {len(found)} definitions named {part!r}")
        nodes = found
    node = nodes[0]
    start = min([node.lineno, *(d.lineno for d in getattr(node, "decorator_list", []))])
    return start, node.end_lineno


def mutate(source: str, mutant: Mutant) -> str:
    """``source`` with the mutation applied inside its function; MutationError unless it matches once."""
    start, end = _function_span(ast.parse(source), mutant.function)
    lines = source.splitlines(keepends=True)
    segment = "".join(lines[start - 1 : end])
    mutated, count = re.subn(mutant.pattern, mutant.replacement, segment)
    if count != 1:
        raise MutationError(f"{mutant.name}: the pattern matches {count} times in {mutant.path}:{mutant.function}")
    if mutated == segment:
        raise MutationError(f"{mutant.name}: the replacement changes nothing")
    return "".join(lines[: start - 1]) + mutated + "".join(lines[end:])


def scratch_copy() -> Path:
    path = Path(tempfile.mkdtemp(prefix="rpb-mutants-"))
    shutil.copytree(ROOT, path / "repo", ignore=_SKIP)
    return path / "repo"


def _kill_kind(junit: Path) -> str | None:
    """'killed' if a listed test failed on an assertion, 'error' if one failed otherwise, None if none failed."""
    if not junit.is_file():
        return "error"
    # pytest's junit XML gives a failure no type attribute: its text ends with the "path:line: ExceptionType" line
    kinds = [(f.get("type") or (f.text or "").rsplit(": ", 1)[-1].strip()) if f.tag == "failure" else f.get("type", "")
             for f in ET.parse(junit).getroot().iter() if f.tag in ("failure", "error")]  # fmt: skip
    if not kinds:
        return None
    return "killed" if any(k.rsplit(".", 1)[-1] in _ASSERTIONS for k in kinds) else "error"


def warm_pytest(scratch: Path) -> WarmPytest:
    """The fork server every mutant of a scratch copy runs in (``forks.py``): the scratch copy first on the path."""
    env = {**os.environ, "PYTHONPATH": f"{scratch / 'src'}{os.pathsep}{scratch}", "RPB_MUTANT_SCRATCH": str(scratch),
           "PYTHONDONTWRITEBYTECODE": "1"}  # fmt: skip
    return WarmPytest(scratch, env)


def run_mutant(scratch: Path, mutant: Mutant, timeout: float, runner: WarmPytest) -> tuple[str, float, str]:
    """(outcome, seconds, detail) of one mutant, its tests run by ``runner`` (``warm_pytest(scratch)``); the
    scratch file is restored afterwards."""
    target = scratch / "src" / "rpb" / mutant.path
    pristine = target.read_text()
    started = time.monotonic()
    try:
        target.write_text(mutate(pristine, mutant))
    except (MutationError, SyntaxError, OSError) as e:
        return "error", 0.0, str(e)
    junit = scratch / f".junit-{mutant.name}.xml"
    args = ["-x", "-q", "-p", "no:cacheprovider", "-p", "tests.mutants.guard", f"--junitxml={junit}", *mutant.tests]
    try:
        code, output = runner.run(args, scratch / f".log-{mutant.name}.txt", timeout)
    finally:
        target.write_text(pristine)
    seconds = time.monotonic() - started
    tail = output.strip().splitlines()[-1:] or [""]
    if code is None:
        return "error", seconds, f"timeout after {timeout:.0f} s"
    if code == GUARD_EXIT:
        return "error", seconds, tail[0]
    if code == 0:
        return "survived", seconds, tail[0]
    if code != 1:  # interrupted, internal error, usage error, nothing collected
        return "error", seconds, f"pytest exit status {code}: {tail[0]}"
    return _kill_kind(junit) or "error", seconds, tail[0]


def table(rows: list[tuple[Mutant, str, float, str]]) -> str:
    out = ["| mutant | the bug | tests | outcome | seconds |", "|---|---|---|---|---|"]
    for m, outcome, seconds, _ in rows:
        tests = ", ".join(f"`{t.split('::')[-1]}`" for t in m.tests)
        out.append(f"| `{m.name}` | {m.story} | {tests} | {outcome} | {seconds:.0f} |")
    return "\n".join(out)


def main(argv: list[str] | None = None) -> int:
    import argparse
    import json

    from tests.mutants.catalogue import MUTANTS

    p = argparse.ArgumentParser(prog="python -m tests.mutants", description=__doc__.splitlines()[0])
    p.add_argument("--ci", action="store_true", help="only the subset CI runs")
    p.add_argument("--only", action="append", default=[], help="this mutant (repeatable)")
    p.add_argument("--timeout", type=float, default=420.0, help="seconds per mutant")
    args = p.parse_args(argv)
    chosen = [m for m in MUTANTS if (not args.ci or m.ci) and (not args.only or m.name in args.only)]
    unknown = set(args.only) - {m.name for m in MUTANTS}
    if unknown:
        p.error(f"unknown mutant(s): {', '.join(sorted(unknown))}")
    scratch = scratch_copy()
    runner = warm_pytest(scratch)
    rows = []
    try:
        for m in chosen:
            outcome, seconds, detail = run_mutant(scratch, m, args.timeout, runner)
            rows.append((m, outcome, seconds, detail))
            print(f"{m.name}: {outcome} ({seconds:.0f} s){'' if outcome == 'killed' else ' -- ' + detail}", flush=True)
    finally:
        runner.close()
        shutil.rmtree(scratch.parent, ignore_errors=True)
    print(table(rows))
    counts = {k: sum(r[1] == k for r in rows) for k in ("killed", "survived", "error")}
    print(json.dumps({"mutants": len(rows), **counts, "seconds": round(sum(r[2] for r in rows), 1)}))
    return 0 if counts["killed"] == len(rows) else 1
