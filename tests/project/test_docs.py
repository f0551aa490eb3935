"""The README and docs/ as a reader meets them: every link resolves, every ``rpb`` command and option
they name exists, the methods table is the code's, and every public name of docs/api.md imports."""

from __future__ import annotations

import importlib
import importlib.util
import re
import shlex
from pathlib import Path

import pytest

from rpb.anchors import methods_table
from rpb.cli import build_parser

ROOT = Path(__file__).resolve().parents[2]
PAGES = [
    ROOT / "README.md",
    *sorted((ROOT / "docs").glob("*.md")),
    *sorted((ROOT / "docs" / "results" / "archive").glob("*.md")),
]
SUBCOMMANDS = build_parser()._subparsers._group_actions[0].choices


def page_id(path: Path) -> str:
    return str(path.relative_to(ROOT))


def slug(heading: str) -> str:
    """GitHub's anchor of a heading: lower case, punctuation dropped, spaces to hyphens."""
    text = re.sub(r"[^\w\- ]", "", heading.strip().lower())
    return text.replace(" ", "-")


def shell_blocks(text: str) -> list[str]:
    """The shell code blocks (```bash, ```sh or unlabelled); ```text blocks show output, not commands."""
    return [
        body
        for lang, body in re.findall(r"^```([a-z]*)\n(.*?)^```", text, flags=re.S | re.M)
        if lang in ("", "bash", "sh")
    ]


def commands(text: str) -> list[str]:
    """Every ``rpb ...`` command line of the shell blocks (continuations joined, comments dropped), and
    every inline code span that names a subcommand or passes an option (``rpb anchor loss``, a log
    key, and ``rpb hard``, a grid arm, are not commands)."""
    out = []
    for block in shell_blocks(text):
        for line in block.replace("\\\n", " ").splitlines():
            line = " ".join(line.split(" #")[0].split())
            m = re.search(r"(?:^|-m )(rpb [a-z].*)$", line)
            if m and not line.startswith("#"):
                out.append(m.group(1))
    prose = re.sub(r"^```.*?^```", "", text, flags=re.S | re.M)
    for span in re.findall(r"`(rpb [a-z][^`]*)`", prose):
        words = span.split()
        if words[1] in SUBCOMMANDS or (len(words) > 2 and words[2].startswith("--")):
            out.append(span)
    return out


SUBCOMMANDS = build_parser()._subparsers._group_actions[0].choices


@pytest.mark.parametrize("page", PAGES, ids=page_id)
def test_relative_links_resolve(page):
    text = page.read_text()
    broken = []
    for target in re.findall(r"\]\(([^)\s]+)\)", text):
        if re.match(r"[a-z]+://", target) or target.startswith("mailto:"):
            continue
        path, _, fragment = target.partition("#")
        dest = (page.parent / path).resolve() if path else page
        if not dest.exists():
            broken.append(target)
        elif fragment and dest.suffix == ".md":
            headings = re.findall(r"^#+ (.*)$", dest.read_text(), flags=re.M)
            if fragment not in {slug(h) for h in headings}:
                broken.append(target)
    assert broken == []


@pytest.mark.parametrize("page", PAGES, ids=page_id)
def test_every_rpb_command_and_option_named_exists(page):
    unknown = []
    for command in commands(page.read_text()):
        words = shlex.split(command.replace("<(", "(").replace("...", ""), comments=False)
        sub = words[1]
        if sub not in SUBCOMMANDS:
            unknown.append(command)
            continue
        options = SUBCOMMANDS[sub]._option_string_actions
        unknown += [f"{sub} {w}" for w in words[2:] if w.startswith("--") and w.split("=")[0] not in options]
        if sub == "train":  # every positional word is an override: key.sub=value
            try:
                parsed = SUBCOMMANDS[sub].parse_known_args(words[2:])[0]
            except SystemExit:
                unknown.append(f"{command}: does not parse")
                continue
            unknown += [f"{sub} {w}: not key.sub=value" for w in parsed.overrides if "=" not in w]
    assert unknown == []


def test_the_readers_find_the_commands():
    """The command scan sees code blocks, continuations and inline spans (else the test above is empty)."""
    text = "x `rpb train --dry-run` `rpb trian --x` `rpb anchor loss` y\n```bash\nrpb collect --model m \\\n"
    text += "  --top-k 6  # note\ntorchrun -m rpb validate a\n```\n```text\nrpb collect: an error\n```\n"
    assert commands(text) == [
        "rpb collect --model m --top-k 6",
        "rpb validate a",
        "rpb train --dry-run",
        "rpb trian --x",
    ]
    assert len(commands((ROOT / "README.md").read_text())) >= 5


def test_the_methods_table_is_the_codes():
    assert methods_table() in (ROOT / "docs" / "methods.md").read_text()


def api_names(text: str) -> list[str]:
    """The dotted names of docs/api.md's mkdocstrings entries (``::: rpb.module.name``), in page order."""
    return re.findall(r"^::: (rpb(?:\.\w+)+)\s*$", text, flags=re.M)


def test_the_api_reader_sees_every_entry():
    text = "# API\n\n::: rpb.a.b\n\n::: rpb.c.d\n    options:\n      x: 1\n`::: rpb.not.an.entry`\n::: other.pkg.x\n"
    assert api_names(text) == ["rpb.a.b", "rpb.c.d"]


def test_every_public_name_in_the_api_page_imports():
    names = api_names((ROOT / "docs" / "api.md").read_text())
    assert len(names) > 80 and len(set(names)) == len(names)
    missing = []
    for dotted in names:
        module, _, name = dotted.rpartition(".")
        try:
            getattr(importlib.import_module(module), name)
        except (ImportError, AttributeError):
            missing.append(dotted)
    assert missing == []


def moved_names(text: str) -> list[tuple[str, str, str]]:
    """``(before, now, name)`` for every name of the CHANGELOG's move tables (rows ``| `old` | `new` | `a`, ... |``)."""
    rows = re.findall(r"^\s*\| `(rpb[\w.]*)` \| `(rpb[\w.]*)` \| (.+) \|$", text, flags=re.M)
    return [(before, now, name) for before, now, names in rows for name in re.findall(r"`(\w+)`", names)]


def test_every_moved_name_imports_from_where_the_changelog_says_and_not_from_before():
    """No compatibility shims (docs/api.md): a moved name imports from its new module only. ``rpb.prior``'s math
    is the one re-export by design (the package's face), and ``rpb.train`` and ``rpb.prior`` are rooms now."""
    moved = moved_names((ROOT / "CHANGELOG.md").read_text())  # newest first
    assert len(moved) > 90 and ("rpb.config", "rpb.errors", "ConfigError") in moved
    wrong = []
    for i, (before, now, name) in enumerate(moved):
        moved_on = any(b == now and n == name for b, _, n in moved[:i])  # a newer row moved it again
        if not moved_on and not hasattr(importlib.import_module(now), name):
            wrong.append(f"{now}.{name}: missing")
        if before in ("rpb.prior", "rpb.train"):
            if hasattr(importlib.import_module(before), name) != (before == "rpb.prior"):
                wrong.append(f"{before}.{name}: a shim")
        elif importlib.util.find_spec(before) is not None and hasattr(importlib.import_module(before), name):
            wrong.append(f"{before}.{name}: still there")  # a module that keeps other names keeps not this one
    assert wrong == []


def routing_kd_lambdas(text: str) -> list[str]:
    """Every ``routing-kd`` set-up of a page's code blocks (or an example's source) that fixes λ: a YAML block whose
    method is ``routing-kd`` and which sets ``lambda:``, or a command or line naming ``routing-kd`` with a λ."""
    found = []
    blocks = [body for _, body in re.findall(r"^```([a-z]*)\n(.*?)^```", text, flags=re.S | re.M)] or [text]
    for block in blocks:
        if re.search(r"method:\s*routing-kd", block) and re.search(r"^\s*lambda:", block, flags=re.M):
            found.append(block.strip().splitlines()[0])
        for line in block.replace("\\\n", " ").splitlines():
            sets_method = re.search(r"method[= ]\s*[\"']?routing-kd|--method routing-kd", line)
            if sets_method and re.search(r"anchor\.lambda=|--lambda\b|lambda_=", line):
                found.append(line.strip())
    return found


def test_the_reader_finds_a_routing_kd_lambda_in_yaml_and_commands():
    yaml_block = "```yaml\nanchor:\n  method: routing-kd\n  lambda: 0.1\n```\n"
    command = "```bash\nrpb train anchor.method=routing-kd \\\n  anchor.lambda=1\n```\n"
    target = "```yaml\nanchor:\n  method: routing-kd\n  target: 0.9\n```\n"
    assert len(routing_kd_lambdas(yaml_block)) == 1 and len(routing_kd_lambdas(command)) == 1
    assert routing_kd_lambdas(target) == []


def test_the_docs_and_examples_show_routing_kd_with_a_target_not_a_lambda():
    """What λ multiplies differs between transforms and sources (docs/methods.md), so a λ shown in the docs would not
    carry over to the reader's run: every routing-kd set-up shown says what to hold instead."""
    sources = [*PAGES, *sorted((ROOT / "examples").rglob("*.py")), *sorted((ROOT / "examples").rglob("*.yaml"))]
    found = {page_id(p): hits for p in sources if (hits := routing_kd_lambdas(p.read_text()))}
    assert found == {}
