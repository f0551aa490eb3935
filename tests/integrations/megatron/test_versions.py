"""Which Megatron-Bridge lines are tested, what is installed, and the warning for anything else; the
docs' table of tested lines is the code's."""

from __future__ import annotations

import re
from pathlib import Path

from rpb.cli import main as rpb_main
from rpb.integrations.megatron.versions import TESTED_LINES, installed_versions, version_warnings

ROOT = Path(__file__).resolve().parents[3]
CONFIG = ROOT / "examples" / "moonlight" / "config.yaml"


def test_the_two_tested_lines_and_their_own_requirements():
    """The requirements as the wheels' metadata states them (Requires-Dist / Requires-Python, read from
    megatron_bridge-0.3.1 and -0.6.2), written out here."""
    assert [(x.bridge, x.transformers, x.python) for x in TESTED_LINES] == [
        ("0.3.1", "<5.0.0", ">=3.10"),
        ("0.6.2", ">=5.8,<=5.12.1", ">=3.12,<3.13"),
    ]


def test_a_tested_combination_gives_no_warning_and_others_say_what_differs():
    ok = {"megatron-bridge": "0.3.1", "megatron-core": "0.16.1", "transformers": "4.57.1", "python": "3.11.7"}
    assert version_warnings(ok) == []
    assert version_warnings({**ok, "megatron-bridge": "0.6.2", "python": "3.12.3", "transformers": "5.12.1"}) == []
    (w,) = version_warnings({**ok, "transformers": "5.24.0"})
    assert w == "transformers 5.24.0 with megatron-bridge 0.3.1, which was tested with transformers<5.0.0"
    (w,) = version_warnings({**ok, "megatron-bridge": "0.5.0"})
    assert w.startswith("megatron-bridge 0.5.0 is not a tested line (0.3.1, 0.6.2)")
    (w,) = version_warnings({**ok, "megatron-bridge": None})
    assert "not installed" in w
    assert len(version_warnings({**ok, "megatron-bridge": "0.6.2"})) == 2  # transformers 4 and Python 3.11


def test_megatron_check_names_the_installed_versions(capsys):
    assert rpb_main(["megatron-check", str(CONFIG)]) == 0
    out = capsys.readouterr().out
    found = installed_versions()
    assert f"transformers {found['transformers']}" in out and f"python {found['python']}" in out
    assert f"megatron-bridge {found['megatron-bridge'] or 'not installed'}" in out
    assert ("warning:" in out) == bool(version_warnings(found))


def test_the_docs_table_is_the_tested_lines():
    text = (ROOT / "docs" / "megatron.md").read_text()
    rows = re.findall(r"^\| `megatron-bridge` (\S+) \| `transformers(\S*)` \| `python(\S*)` \|", text, re.M)
    assert rows == [(x.bridge, x.transformers, x.python) for x in TESTED_LINES]


def test_the_bridge_environments_requirements_are_rpbs_minus_what_bridge_pins():
    import tomllib
    from packaging.requirements import Requirement

    deps = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["dependencies"]
    bridge_pins = {"torch", "transformers", "tokenizers", "huggingface-hub"}
    wanted = sorted(str(Requirement(d)) for d in deps if Requirement(d).name not in bridge_pins)
    lines = (ROOT / "examples" / "moonlight" / "requirements-rpb.txt").read_text().splitlines()
    listed = sorted(str(Requirement(x)) for x in lines if x.strip() and not x.startswith("#"))
    assert listed == wanted
