"""The shape of the house, read from the source: what may import what, file sizes, and tests that mirror src/.

Imports are read with ``ast`` (every ``import`` and ``from ... import``, at any depth, lazy ones
included), so a rule cannot be dodged by importing inside a function.
"""

from __future__ import annotations

import ast
import functools
import os
import shutil
import subprocess
import sys
from pathlib import Path

import networkx as nx
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
    out = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            out |= {a.name for a in node.names}
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:  # only src/ imports relatively: the tests' files never do
                package = module_name(path) if path.name == "__init__.py" else module_name(path).rpartition(".")[0]
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


@pytest.mark.parametrize("name", ["prior/math.py", "routing.py"])
def test_pure_math_imports_nothing_from_rpb(name):
    found = sorted(m for m in imported_modules(SRC / name) if m == "rpb" or m.startswith("rpb."))
    assert found == [], f"{name} imports {found}"


def core_files() -> list[Path]:
    """Every src module outside the toy world: what must run with rpb/toyworld/ removed."""
    return [p for p in source_files() if not p.is_relative_to(SRC / "toyworld")]


def names_the_toy_world(text: str) -> bool:
    return text == "rpb.toyworld" or text.startswith("rpb.toyworld.") or text.startswith("rpb.toyworld:")


def toy_world_offenders() -> tuple[list[str], list[str]]:
    """(core modules that import the toy world, core modules with a string naming it to import it by)."""
    importers = [module_name(p) for p in core_files() if any(names_the_toy_world(m) for m in imported_modules(p))]
    naming = [
        module_name(p)
        for p in core_files()
        for node in ast.walk(ast.parse(p.read_text(), filename=str(p)))
        if isinstance(node, ast.Constant) and isinstance(node.value, str) and names_the_toy_world(node.value)
    ]
    return importers, naming


def test_the_core_imports_nothing_of_the_toy_world():
    """The toy world reaches the command line through its ``rpb.commands`` entry point (pyproject.toml),
    never the other way: no import of it, and no string naming it to import it by (importlib, entry points)."""
    assert toy_world_offenders() == ([], [])


def test_the_toy_world_check_catches_an_offender(tmp_path, monkeypatch):
    root = tmp_path / "rpb"
    for folder in ("sub", "toyworld"):
        (root / folder).mkdir(parents=True)
    (root / "__init__.py").write_text('"""the toy world is named in prose only."""\n')
    (root / "clean.py").write_text('NOTE = "rpb.toyworldly is another package"\n')
    (root / "lazy.py").write_text("def f():\n    from rpb.toyworld.demo import run_demo\n")
    (root / "sub" / "relative.py").write_text("from ..toyworld import tasks\n")
    (root / "by_name.py").write_text('import importlib\nMOD = importlib.import_module("rpb.toyworld.cli")\n')
    (root / "plugin.py").write_text('SPEC = "rpb.toyworld:add_commands"\n')
    (root / "toyworld" / "own.py").write_text('from rpb.toyworld import demo\nNAME = "rpb.toyworld"\n')
    monkeypatch.setattr(f"{__name__}.SRC", root)
    assert toy_world_offenders() == (["rpb.lazy", "rpb.sub.relative"], ["rpb.by_name", "rpb.plugin"])


def test_the_toy_world_is_registered_as_a_command_plugin():
    from importlib.metadata import entry_points

    assert "rpb.toyworld.cli:add_commands" in {ep.value for ep in entry_points(group="rpb.commands")}


#: the top level of src/rpb keeps what every room stands on (docs/layout.md): the package face, __main__, the
#: named errors, atomic writes, model loading, and the pure routing and loss math
TOP_LEVEL_MAX = 7


def room_of(module: str) -> str | None:
    """The room of a dotted rpb module: its first-level package, or the top-level module itself (``__init__``
    for the package face, which every import of rpb runs); None outside rpb."""
    parts = module.split(".")
    if parts[0] != "rpb":
        return None
    return parts[1] if len(parts) > 1 else "__init__"


def room_graph() -> nx.DiGraph:
    """Nodes: each first-level package and each top-level module of src/rpb. Edges: room -> room for every
    import any of its modules makes (lazy ones included), each edge keeping one ``importer -> imported``."""
    graph = nx.DiGraph()
    graph.add_nodes_from(p.name for p in SRC.iterdir() if (p / "__init__.py").is_file())
    graph.add_nodes_from(p.stem for p in SRC.glob("*.py"))
    for path in source_files():
        here = room_of(module_name(path)) if path.name != "__main__.py" else "__main__"
        for imported in sorted(imported_modules(path)):
            there = room_of(imported)
            if there in graph and there != here and not graph.has_edge(here, there):
                graph.add_edge(here, there, via=f"{module_name(path)} -> {imported}")
    return graph


def room_cycles(graph: nx.DiGraph) -> list[str]:
    """Each cycle of rooms, with the import that makes each of its steps."""
    out = []
    for cycle in nx.simple_cycles(graph):
        start = cycle.index(min(cycle))  # each cycle read from its first room by name, so the list is stable
        cycle = [*cycle[start:], *cycle[:start]]
        steps = zip(cycle, [*cycle[1:], cycle[0]], strict=True)
        out.append(" ; ".join(graph.edges[a, b]["via"] for a, b in steps))
    return sorted(out)


def test_the_rooms_import_one_another_without_a_cycle():
    """A room that imports one that imports it back is one capability split in two, or a helper living in the
    wrong room: move the helper to what it is about."""
    assert room_cycles(room_graph()) == []


def test_the_room_graph_catches_a_cycle_through_a_lazy_import(tmp_path, monkeypatch):
    root = tmp_path / "rpb"
    for rel, text in {
        "__init__.py": "",
        "errors.py": "",
        "a/__init__.py": "from rpb.a.x import f\n",
        "a/x.py": "from rpb.errors import E\ndef f():\n    from rpb.b import g\n",
        "b/__init__.py": "from rpb.b.y import g\n",
        "b/y.py": "from ..a import f\n",
        "c/__init__.py": "from rpb import errors\n",
    }.items():
        (root / rel).parent.mkdir(parents=True, exist_ok=True)
        (root / rel).write_text(text)
    monkeypatch.setattr(f"{__name__}.SRC", root)
    graph = room_graph()
    assert set(graph) == {"__init__", "errors", "a", "b", "c"}
    assert room_cycles(graph) == ["rpb.a.x -> rpb.b ; rpb.b.y -> rpb.a"]


def test_the_top_level_keeps_only_what_every_room_stands_on():
    modules = sorted(p.name for p in SRC.glob("*.py"))
    assert len(modules) <= TOP_LEVEL_MAX, modules
    assert (SRC / "train" / "__init__.py").is_file() and (SRC / "prior" / "__init__.py").is_file()


def test_the_layout_page_states_the_room_count():
    graph = room_graph()
    packages = sum((SRC / room / "__init__.py").is_file() for room in graph)
    text = " ".join((ROOT / "docs" / "layout.md").read_text().split())
    stated = f"{packages} rooms (packages) and {len(graph) - packages} top-level modules"
    assert stated in text, f"docs/layout.md should say: {stated}"


#: fast core test files (a few seconds each) that must pass with the toy world gone
CORE_TESTS = ("tests/train/test_config.py", "tests/prior/test_math.py", "tests/test_routing.py")


def test_the_core_runs_without_the_toy_world(tmp_path):
    """src/rpb copied without toyworld/ and put first on the path: every core module imports, ``rpb --help``
    works (naming the plugin that failed to load), and a few core test files pass against the copy."""
    copy = tmp_path / "src"
    shutil.copytree(SRC, copy / "rpb", ignore=shutil.ignore_patterns("toyworld", "__pycache__"))
    env = {**os.environ, "PYTHONPATH": str(copy), "OMP_NUM_THREADS": "1"}
    modules = sorted(module_name(p) for p in core_files() if p.name != "__main__.py")
    check = (
        "import importlib, importlib.util, sys, rpb\n"
        f"assert rpb.__file__.startswith({str(copy)!r}), rpb.__file__\n"
        "assert importlib.util.find_spec('rpb.toyworld') is None\n"
        "for name in sys.argv[1:]:\n"
        "    try:\n"
        "        importlib.import_module(name)\n"
        "    except ModuleNotFoundError as e:  # an optional dependency (axolotl, megatron) not installed here\n"
        "        if e.name.split('.')[0] == 'rpb':\n"
        "            raise\n"
    )
    run = functools.partial(subprocess.run, cwd=ROOT, env=env, capture_output=True, text=True, timeout=120)
    imported = run([sys.executable, "-c", check, *modules])
    assert imported.returncode == 0, imported.stderr
    helped = run([sys.executable, "-m", "rpb", "--help"])
    assert helped.returncode == 0, helped.stderr
    assert "collect" in helped.stdout and "failed to load" in helped.stdout
    asked = run([sys.executable, "-m", "rpb", "demo"])
    assert asked.returncode == 2 and "No module named 'rpb.toyworld'" in asked.stderr
    tested = run([sys.executable, "-m", "pytest", "-x", "-q", "-p", "no:cacheprovider", *CORE_TESTS])
    assert tested.returncode == 0, tested.stdout[-3000:]


#: the toy world's floors, lowest first: a module imports only from its own floor or those below it
TOY_FLOORS = ("world", "study", "grids")


def toy_floor(module: str) -> int | None:
    """The floor of a toy-world module (``len(TOY_FLOORS)`` for the commands above them: cli, demo, ...)."""
    parts = module.split(".")
    if parts[:2] != ["rpb", "toyworld"] or len(parts) < 3:
        return None
    return TOY_FLOORS.index(parts[2]) if parts[2] in TOY_FLOORS else len(TOY_FLOORS)


def toy_floor_offenders() -> list[str]:
    """Each toy-world import from a floor to a higher one (``world`` -> ``study`` or ``grids``, ``study`` ->
    ``grids``), as ``importer -> imported``."""
    found = []
    for path in source_files():
        here = toy_floor(module_name(path))
        if here is None:
            continue
        for imported in sorted(imported_modules(path)):
            there = toy_floor(imported)
            if there is not None and there > here and imported != "rpb.toyworld":
                found.append(f"{module_name(path)} -> {imported}")
    return found


def test_the_toy_worlds_floors_import_only_downwards():
    """``world/`` imports nothing of ``study/`` or ``grids/``; ``study/`` nothing of ``grids/``."""
    assert toy_floor_offenders() == []


#: strings of the machinery that spell a grid's name but mean something else
NOT_GRIDS = {
    "beta": "the AnchorConfig field a cell's anchor holds",
    "rl": "the key of an RL cell's record",
    "demo": "the `rpb demo` command",
}


def grid_names_in(path: Path, names: set[str]) -> list[str]:
    """Where ``path`` names a grid: a string constant (docstrings left out) that is a grid's name (or its module's)
    and not in ``NOT_GRIDS``, and any comparison of a ``.name`` with a grid's name (those in ``NOT_GRIDS`` too)."""
    tree = ast.parse(path.read_text(), filename=str(path))
    docstrings = {
        id(node.body[0].value)
        for node in ast.walk(tree)
        if isinstance(node, ast.Module | ast.ClassDef | ast.FunctionDef | ast.AsyncFunctionDef)
        and node.body
        and isinstance(node.body[0], ast.Expr)
        and isinstance(node.body[0].value, ast.Constant)
    }
    where = str(path.relative_to(SRC))
    found = [
        f"{where}: {node.value!r}"
        for node in ast.walk(tree)
        if isinstance(node, ast.Constant) and isinstance(node.value, str) and id(node) not in docstrings
        and node.value in names - set(NOT_GRIDS)
    ]  # fmt: skip
    for node in ast.walk(tree):
        if isinstance(node, ast.Compare):
            sides = [node.left, *node.comparators]
            named = any(isinstance(s, ast.Attribute) and s.attr == "name" for s in sides)
            strings = any(isinstance(c, ast.Constant) and c.value in names for s in sides for c in ast.walk(s))
            if named and strings:
                found.append(f"{where}:{node.lineno}: compares a name with a grid's")
    return found


def test_the_machinery_names_no_grid():
    """The study machinery (``study/``, and the command line) runs a grid from its fields alone: no string of it is
    a shipped grid's name, no ``.name`` is compared with one, and it imports no grid module."""
    from rpb.toyworld.grids import grids

    names = {*grids(), *(g.replace("-", "_") for g in grids())}
    machinery = [*sorted((SRC / "toyworld" / "study").glob("*.py")), SRC / "toyworld" / "cli.py"]
    assert [hit for p in machinery for hit in grid_names_in(p, names)] == []
    modules = {module_name(p) for p in (SRC / "toyworld" / "grids").glob("*.py") if p.name != "__init__.py"}
    importers = [module_name(p) for p in machinery if imported_modules(p) & modules]
    assert importers == []


def test_the_floor_and_name_checks_catch_an_offender(tmp_path, monkeypatch):
    root = tmp_path / "rpb"
    for folder in ("toyworld/world", "toyworld/study"):
        (root / folder).mkdir(parents=True)
    (root / "toyworld" / "world" / "up.py").write_text("def f():\n    from rpb.toyworld.study import cells\n")
    (root / "toyworld" / "study" / "named.py").write_text(
        '"""the full grid, in prose."""\nKIND = "full"\nANCHOR = "beta"\n'
        'def f(g, p):\n    return g.name == "beta" or p.name == "x"\n'
    )
    monkeypatch.setattr(f"{__name__}.SRC", root)
    assert toy_floor_offenders() == [
        "rpb.toyworld.world.up -> rpb.toyworld.study",
        "rpb.toyworld.world.up -> rpb.toyworld.study.cells",
    ]
    assert grid_names_in(root / "toyworld" / "study" / "named.py", {"full", "beta"}) == [
        "toyworld/study/named.py: 'full'",
        "toyworld/study/named.py:5: compares a name with a grid's",
    ]


def test_nothing_in_src_imports_the_tests():
    offenders = [module_name(p) for p in source_files() if any(m.split(".")[0] == "tests" for m in imported_modules(p))]
    assert offenders == []


def test_no_source_file_is_longer_than_one_sitting():
    long = {str(p.relative_to(SRC)): n for p in source_files() if (n := len(p.read_text().splitlines())) > MAX_LINES}
    assert long == {}, (
        f"longer than {MAX_LINES} lines: {long}; split each along a responsibility (one module per job), "
        "never squeeze it (joined lines, `# fmt: skip`, shortened names)"
    )


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


def scripts_run_by_path() -> set[Path]:
    """Files under tests/ that a test names by file name ("x.py" in its source), to run as a process."""
    named = set()
    for test in TESTS.rglob("*.py"):
        for node in ast.walk(ast.parse(test.read_text(), filename=str(test))):
            if isinstance(node, ast.Constant) and isinstance(node.value, str) and node.value.endswith(".py"):
                named.add(Path(node.value).name)
    return {p for p in TESTS.rglob("*.py") if p.name in named and not p.name.startswith(("test_", "conftest", "__"))}


def test_a_script_run_by_path_shares_its_folder_with_no_package():
    """``python folder/x.py`` puts folder/ first on sys.path, so a package beside x.py shadows any installed
    one of its name: tests/kernels (mirroring rpb.kernels) hid Hugging Face's kernels from transformers in
    the workers that once sat in tests/."""
    scripts = scripts_run_by_path()
    assert {"resume_worker.py", "fsdp_worker.py"} <= {p.name for p in scripts}
    crowded = [
        f"{s.relative_to(TESTS)} beside {d.name}/"
        for s in scripts
        for d in s.parent.iterdir()
        if (d / "__init__.py").is_file()
    ]
    assert crowded == []


#: Modules without a test file of their own (tests/<package>/test_<stem>.py or test_<stem>_*.py), each
#: with the test files that import it (read with ast; a name its package re-exports from it counts).
#: An entry no longer needed (the module got its own test file, or is gone) fails the check.
TESTED_THROUGH: dict[str, tuple[str, ...]] = {
    "anchors/config.py": ("anchors/test_handle.py", "anchors/test_methods.py"),
    "anchors/context.py": ("data/test_batches.py",),
    "anchors/prior_routing.py": ("train/test_run_controls.py",),
    "anchors/verify.py": ("train/test_run.py", "calibrate/test_run.py"),
    "collect/rows.py": ("collect/test_collector.py",),
    "collect/store.py": ("collect/test_collector.py",),
    "data/errors.py": ("data/test_dataset.py", "data/test_template.py"),
    "data/tokens.py": ("data/test_template.py",),
    "errors.py": ("test_models.py", "adapters/test_hf.py"),
    "experts/choice.py": ("experts/test_run.py",),
    "integrations/megatron/install.py": ("integrations/megatron/test_router.py",),
    "losses.py": ("anchors/test_methods.py",),
    "train/audit.py": ("train/test_run_wiring.py",),
    "monitor/verdict.py": ("monitor/test_audit.py",),
    "retention/markdown.py": ("retention/test_plots.py",),
    "retention/stats.py": ("retention/test_run.py",),
    "testing/data.py": ("testing/test_models.py",),
    "testing/tokenizers.py": ("testing/test_models.py", "toyworld/world/test_tasks.py"),
    "toyworld/grids/cot.py": ("toyworld/test_grids.py", "toyworld/study/test_cells_cot.py"),
    "toyworld/grids/demo.py": ("toyworld/test_grids.py", "toyworld/test_demo.py"),
    "toyworld/grids/full.py": ("toyworld/test_grids.py",),
    "toyworld/grids/headline.py": ("toyworld/test_grids.py",),
    "toyworld/grids/small.py": ("toyworld/test_grids.py",),
    "toyworld/world/knowledge.py": ("toyworld/world/test_tasks.py",),
    "train/trainer.py": ("train/test_run_wiring.py", "train/test_checkpoints.py"),
}
#: Modules no test file imports at all: known gaps, not coverage. Each names the test file and the module
#: it imports through which the tests reach this one (both links read with ast). Give such a module a test
#: and move it up: an entry fails once a test file imports the module, or it has a test file of its own.
ONLY_REACHED_THROUGH: dict[str, tuple[str, str]] = {
    "calibrate/report.py": ("calibrate/test_run.py", "rpb.calibrate.run"),
    "calibrate/startup.py": ("train/test_start.py", "rpb.train.start"),
    "collect/dist.py": ("collect/test_collector.py", "rpb.collect.collector"),
    "data/render.py": ("cli/test_prior.py", "rpb.cli.prior"),
    "integrations/megatron/figures.py": ("integrations/megatron/test_router.py", "rpb.integrations.megatron.router"),
}


def source_path(module: str) -> Path:
    """src/ file of a dotted rpb module (a package's __init__.py)."""
    path = SRC.parent.joinpath(*module.split("."))
    return path / "__init__.py" if path.is_dir() else path.with_suffix(".py")


def reexported_from(package: str) -> dict[str, str]:
    """``{name: module}`` for every name the package's ``__init__.py`` imports from a module."""
    init = source_path(package)
    if init.name != "__init__.py" or not init.is_file():
        return {}
    out = {}
    for node in ast.walk(ast.parse(init.read_text(), filename=str(init))):
        if isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join([*anchor, base] if base else anchor)
            out |= {a.asname or a.name: base for a in node.names}
    return out


def modules_a_test_imports(test: Path) -> set[str]:
    """Every module the test file imports, plus the module each name it takes from an rpb package comes from."""
    found = imported_modules(test)
    for name in list(found):
        package, _, attr = name.rpartition(".")
        if package.split(".")[0] == "rpb" and attr in (origin := reexported_from(package)):
            found.add(origin[attr])
    return found


def has_own_test(path: Path) -> bool:
    folder = TESTS.joinpath(*path.relative_to(SRC).parts[:-1])
    return any(folder.glob(f"test_{path.stem}.py")) or any(folder.glob(f"test_{path.stem}_*.py"))


def coverage_problems() -> list[str]:
    """Each module without a test file of its own, not vouched for by a table entry; each stale entry."""
    modules = {str(p.relative_to(SRC)): p for p in source_files() if p.name not in ("__init__.py", "__main__.py")}
    tests = {str(t.relative_to(TESTS)): t for t in TESTS.rglob("test_*.py")}
    imports = {rel: modules_a_test_imports(t) for rel, t in tests.items()}
    problems = []
    for rel, path in modules.items():
        listed = rel in TESTED_THROUGH or rel in ONLY_REACHED_THROUGH
        if has_own_test(path) and listed:
            problems.append(f"{rel}: has a test file of its own now; drop its table entry")
        elif not has_own_test(path) and not listed:
            problems.append(f"{rel}: no test file of its own (test_{path.stem}.py beside its package's tests)")
    for rel, named in TESTED_THROUGH.items():
        if rel not in modules:
            problems.append(f"{rel}: no such module; drop its entry")
            continue
        module = module_name(modules[rel])
        problems += [f"{rel}: no test file {t}" for t in named if t not in imports]
        problems += [f"{rel}: {t} does not import it" for t in named if t in imports and module not in imports[t]]
    for rel, (test, via) in ONLY_REACHED_THROUGH.items():
        if rel not in modules:
            problems.append(f"{rel}: no such module; drop its entry")
            continue
        module = module_name(modules[rel])
        problems += [f"{rel}: {t} imports it now; move it to TESTED_THROUGH" for t in imports if module in imports[t]]
        if test not in imports:
            problems.append(f"{rel}: no test file {test}")
        elif via not in imports[test]:
            problems.append(f"{rel}: {test} does not import {via}")
        elif module not in imported_modules(source_path(via)):
            problems.append(f"{rel}: {via} does not import it")
    return problems


def check_every_source_module_is_tested() -> None:
    problems = coverage_problems()
    assert problems == [], "\n".join(problems)


def test_every_source_module_has_its_own_tests_or_named_ones():
    check_every_source_module_is_tested()


@pytest.fixture
def tiny_tree(tmp_path, monkeypatch):
    """src/rpb/pkg/ with a.py (its own test file) and b.py (tested through test_a.py, which takes the name
    ``thing`` the package re-exports from b), and empty tables; returns a writer for more files."""

    def write(rel: str, text: str = "") -> None:
        path = tmp_path / rel
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)

    write("src/rpb/__init__.py")
    write("src/rpb/pkg/__init__.py", "from .b import thing\n")
    write("src/rpb/pkg/a.py", "x = 1\n")
    write("src/rpb/pkg/b.py", "thing = 2\n")
    write("tests/pkg/test_a.py", "from rpb.pkg.a import x\nfrom rpb.pkg import thing\n")
    monkeypatch.setattr(f"{__name__}.SRC", tmp_path / "src" / "rpb")
    monkeypatch.setattr(f"{__name__}.TESTS", tmp_path / "tests")
    monkeypatch.setattr(f"{__name__}.TESTED_THROUGH", {"pkg/b.py": ("pkg/test_a.py",)})
    monkeypatch.setattr(f"{__name__}.ONLY_REACHED_THROUGH", {})
    return write


def test_a_re_exported_name_counts_as_importing_its_module(tiny_tree):
    check_every_source_module_is_tested()  # the tree as built passes: b is reached through its re-export


def test_mutant_module_without_tests_is_caught(tiny_tree):
    tiny_tree("src/rpb/pkg/c.py", "y = 3\n")  # a new module, no test file, no entry
    with pytest.raises(AssertionError, match=r"pkg/c\.py: no test file of its own"):
        check_every_source_module_is_tested()


def test_mutant_tests_elsewhere_in_the_package_are_not_enough_is_caught(tiny_tree):
    """What the old rule accepted: a module whose package folder has tests, none of them about it."""
    tiny_tree("src/rpb/pkg/c.py", "y = 3\n")
    TESTED_THROUGH["pkg/c.py"] = ("pkg/test_a.py",)  # test_a.py imports a and b, not c
    with pytest.raises(AssertionError, match=r"pkg/c\.py: pkg/test_a\.py does not import it"):
        check_every_source_module_is_tested()


def test_mutant_name_not_from_the_module_is_caught(tiny_tree):
    """A name the package defines itself, or takes from another module, does not vouch for b."""
    tiny_tree("src/rpb/pkg/__init__.py", "from .a import x as thing\n")
    with pytest.raises(AssertionError, match=r"pkg/b\.py: pkg/test_a\.py does not import it"):
        check_every_source_module_is_tested()


@pytest.mark.parametrize("stale", ["own_test", "gone"])
def test_mutant_stale_table_entry_is_caught(tiny_tree, stale):
    if stale == "own_test":
        tiny_tree("tests/pkg/test_b_more.py", "from rpb.pkg.b import thing\n")
    else:
        TESTED_THROUGH["pkg/gone.py"] = ("pkg/test_a.py",)
    with pytest.raises(AssertionError, match=r"has a test file of its own now|no such module"):
        check_every_source_module_is_tested()


def test_mutant_gap_entry_left_after_a_test_imports_it_is_caught(tiny_tree):
    tiny_tree("src/rpb/pkg/c.py", "y = 3\n")
    tiny_tree("src/rpb/pkg/a.py", "from rpb.pkg import c\nx = 1\n")
    ONLY_REACHED_THROUGH["pkg/c.py"] = ("pkg/test_a.py", "rpb.pkg.a")
    check_every_source_module_is_tested()  # reached through a: a known gap, allowed
    tiny_tree("tests/pkg/test_a.py", "from rpb.pkg.a import x\nfrom rpb.pkg import thing, c\n")
    with pytest.raises(AssertionError, match=r"pkg/c\.py: pkg/test_a\.py imports it now"):
        check_every_source_module_is_tested()
