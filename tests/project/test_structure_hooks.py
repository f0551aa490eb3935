"""Routers are hooked in one place: no src module outside ``rpb/observe/`` registers a forward hook or a
forward pre-hook (``rpb.observe.hooks`` hands router calls, router inputs and the model's inputs to whoever
asks). Read with ``ast``: a call, a bound method kept for later (``f = m.register_forward_hook``) and a
``getattr`` by name all count, at any depth."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
SRC = ROOT / "src" / "rpb"
HOOKS = frozenset({"register_forward_hook", "register_forward_pre_hook"})
#: the package that observes routers
OBSERVE = "observe"
#: modules that hook for something other than reading routers, each with why
ALLOWED: dict[str, str] = {
    # swaps the fused experts' kernel in for the model's forward and back out: no router is read
    "kernels/experts.py": "model hooks around the forward for the expert kernels",
    # installs the per-expert gradient masks before each forward of the experts' owner: no router is read
    "experts/masks.py": "a pre-hook installing gradient masks on the experts",
}


def hook_lines(path: Path) -> list[int]:
    """The lines of ``path`` that name a forward (pre-)hook registration: an attribute or a string."""
    tree = ast.parse(path.read_text(), filename=str(path))
    found = []
    for node in ast.walk(tree):
        if (isinstance(node, ast.Attribute) and node.attr in HOOKS) or (
            isinstance(node, ast.Constant) and node.value in HOOKS
        ):
            found.append(node.lineno)
    return sorted(found)


def hook_problems() -> list[str]:
    """Each module outside ``observe/`` that registers hooks without an allow-list entry; each stale entry."""
    problems = []
    registering = set()
    for path in sorted(SRC.rglob("*.py")):
        rel = path.relative_to(SRC)
        lines = hook_lines(path)
        if not lines:
            continue
        registering.add(str(rel))
        if rel.parts[0] != OBSERVE and str(rel) not in ALLOWED:
            problems.append(f"{rel}:{lines[0]}: registers a forward hook outside rpb/{OBSERVE}/ (use rpb.observe)")
    problems += [
        f"{rel}: registers no hook any more; drop its ALLOWED entry" for rel in ALLOWED if rel not in registering
    ]
    if not any(Path(rel).parts[0] == OBSERVE for rel in registering):
        problems.append(f"rpb/{OBSERVE}/ registers no hook: the reader finds nothing")
    return problems


def check_routers_are_hooked_in_one_place() -> None:
    problems = hook_problems()
    assert problems == [], "\n".join(problems)


def test_routers_are_hooked_only_through_rpb_observe():
    check_routers_are_hooked_in_one_place()


# ---- the checker against a tiny tree --------------------------------------------------------------------


@pytest.fixture
def tiny_tree(tmp_path, monkeypatch):
    """src/rpb/ with observe/hooks.py registering a hook and the allowed modules each registering one;
    returns a writer for more files."""

    def write(rel: str, text: str) -> None:
        path = tmp_path / rel
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)

    write("observe/hooks.py", "def on(m, f):\n    return m.register_forward_hook(f)\n")
    write("kernels/experts.py", "def go(model, f):\n    model.register_forward_pre_hook(f, with_kwargs=True)\n")
    write("experts/masks.py", "def go(owner, f):\n    owner.register_forward_pre_hook(f)\n")
    write("monitor/routing.py", "from rpb.observe.hooks import on\n")
    monkeypatch.setattr(f"{__name__}.SRC", tmp_path)
    return write


def test_the_tiny_tree_as_built_passes(tiny_tree):
    check_routers_are_hooked_in_one_place()


@pytest.mark.parametrize(
    "text",
    [
        "def attach(router, f):\n    return router.register_forward_hook(f)\n",
        "class M:\n    def attach(self):\n        self.model.register_forward_pre_hook(self._read, with_kwargs=True)\n",
        "def attach(router, f):\n    hook = router.register_forward_hook\n    return hook(f)\n",
        'def attach(router, f):\n    return getattr(router, "register_forward_hook")(f)\n',
    ],
    ids=["call", "nested-pre-hook", "bound-method", "getattr"],
)
def test_mutant_a_hook_outside_observe_is_caught(tiny_tree, text):
    tiny_tree("monitor/routing.py", text)
    with pytest.raises(AssertionError, match=r"monitor/routing\.py:\d+: registers a forward hook outside"):
        check_routers_are_hooked_in_one_place()


def test_mutant_stale_allow_list_entry_is_caught(tiny_tree):
    tiny_tree("experts/masks.py", "def go(owner, f):\n    return None\n")
    with pytest.raises(AssertionError, match=r"experts/masks\.py: registers no hook any more"):
        check_routers_are_hooked_in_one_place()


def test_mutant_blind_reader_is_caught(tiny_tree):
    tiny_tree("observe/hooks.py", "def on(m, f):\n    return None\n")
    with pytest.raises(AssertionError, match=r"observe/ registers no hook"):
        check_routers_are_hooked_in_one_place()
