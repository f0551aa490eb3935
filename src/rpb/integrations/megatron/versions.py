"""The Megatron-Bridge lines rpb is tested with, and what is installed, read from package metadata.

Nothing is imported: ``rpb megatron-check`` and ``examples/moonlight/train.py --dry-run`` name the
installed versions on a machine without GPUs, and warn when the combination is not one of
``TESTED_LINES``. Each Bridge line pins transformers narrowly (v0.3.1: below 5; 0.6.x: 5.8 to
5.12.1) and 0.4 onwards needs Python 3.12, so no single environment holds two lines.

Moving the pin: add or replace a ``Line`` here (the requirements read from that wheel's
``Requires-Dist`` / ``Requires-Python``), and the table in docs/megatron.md with it; a test
keeps the two equal.
"""

from __future__ import annotations

import platform
from dataclasses import dataclass
from importlib import metadata

from packaging.specifiers import SpecifierSet
from packaging.version import Version

PACKAGES = ("megatron-bridge", "megatron-core", "transformers")


@dataclass(frozen=True)
class Line:
    """One tested megatron-bridge release and what its wheel requires."""

    bridge: str
    megatron_core: str
    transformers: str
    python: str

    def requirements(self) -> dict[str, str]:
        return {"megatron-core": self.megatron_core, "transformers": self.transformers, "python": self.python}


TESTED_LINES: tuple[Line, ...] = (
    # the reference release's line
    Line(bridge="0.3.1", megatron_core=">=0.15.0a0,<0.17.0", transformers="<5.0.0", python=">=3.10"),
    # the current release on the package registry (2026-12)
    Line(bridge="0.6.2", megatron_core=">=0.16", transformers=">=5.8,<=5.12.1", python=">=3.12,<3.13"),
)


def installed_versions() -> dict[str, str | None]:
    """megatron-bridge, megatron-core and transformers as installed (None: not installed), and Python."""
    out: dict[str, str | None] = {}
    for name in PACKAGES:
        try:
            out[name] = metadata.version(name)
        except metadata.PackageNotFoundError:
            out[name] = None
    out["python"] = platform.python_version()
    return out


def version_warnings(found: dict[str, str | None]) -> list[str]:
    """Where ``found`` is not one of the tested lines (empty: a tested combination)."""
    tested = ", ".join(line.bridge for line in TESTED_LINES)
    bridge = found.get("megatron-bridge")
    if bridge is None:
        return [f"megatron-bridge is not installed here: training needs one of the tested lines ({tested})"]
    line = next((x for x in TESTED_LINES if Version(x.bridge) == Version(bridge)), None)
    if line is None:
        return [f"megatron-bridge {bridge} is not a tested line ({tested}); the anchor's guard still checks the "
                "effective configuration, but the glue has not met this release"]  # fmt: skip
    out = []
    for name, spec in line.requirements().items():
        have = found.get(name)
        if have is None:
            out.append(f"{name} is not installed; megatron-bridge {bridge} needs {name}{spec}")
        elif Version(have) not in SpecifierSet(spec, prereleases=True):
            out.append(f"{name} {have} with megatron-bridge {bridge}, which was tested with {name}{spec}")
    return out


def describe(found: dict[str, str | None]) -> str:
    return ", ".join(f"{name} {found[name] or 'not installed'}" for name in (*PACKAGES, "python"))
