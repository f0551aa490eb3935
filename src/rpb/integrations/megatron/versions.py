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
    """One tested megatron-bridge release, what its wheel requires, and what its contract-test folder holds
    (``pins``: installed with ``pip install --no-deps --target``, one folder a line, never one environment)."""

    bridge: str
    megatron_core: str
    transformers: str
    python: str
    pins: tuple[str, ...] = ()
    #: the Python the folder's wheels are chosen for (None: this interpreter's; the tests import them)
    target_python: str | None = None

    def requirements(self) -> dict[str, str]:
        return {"megatron-core": self.megatron_core, "transformers": self.transformers, "python": self.python}


# fmt: skip below: a table of data, kept aligned row by row (the formatter would put one item per line)
TESTED_LINES: tuple[Line, ...] = (
    # the reference release's line: imported on this machine's Python, with a transformers 4.x of its own and
    # what Bridge's SFT dataset imports (its other deps: Transformer Engine, ModelOpt, are GPU-only)
    Line(
        bridge="0.3.1", megatron_core=">=0.15.0a0,<0.17.0", transformers="<5.0.0", python=">=3.10",
        pins=("megatron-bridge==0.3.1", "megatron-core==0.16.1", "transformers==4.57.3", "tokenizers==0.22.1",
              "huggingface-hub==0.36.0", "datasets==4.4.1", "hydra-core==1.3.2", "omegaconf==2.3.0",
              "antlr4-python3-runtime==4.9.3", "requests==2.32.5", "urllib3==2.5.0", "certifi==2025.11.12",
              "charset-normalizer==3.4.4", "httpx==0.28.1", "httpcore==1.0.9", "h11==0.16.0", "anyio==4.12.0",
              "sniffio==1.3.1", "six==1.17.0"),
    ),
    # the current release on the package registry (2026-12): Python 3.12 only, so read, not imported
    Line(
        bridge="0.6.2", megatron_core=">=0.16", transformers=">=5.8,<=5.12.1", python=">=3.12,<3.13",
        pins=("megatron-bridge==0.6.2", "megatron-core==0.19.2"), target_python="3.12",
    ),
)  # fmt: skip


def pip_target_args(line: Line) -> list[str]:
    """``pip install`` arguments that put ``line``'s contract-test folder's packages in place (``--target`` is
    the caller's)."""
    platform_args = ["--python-version", line.target_python, "--only-binary=:all:"] if line.target_python else []
    return ["--no-deps", *platform_args, *line.pins]


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
        return [
            f"megatron-bridge {bridge} is not a tested line ({tested}); the anchor's guard still checks the "
            "effective configuration, but the glue has not met this release"
        ]
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


if __name__ == "__main__":  # the Makefile: python -m rpb.integrations.megatron.versions pip-args 0.3.1
    import sys

    if len(sys.argv) == 3 and sys.argv[1] == "pip-args":
        print(" ".join(pip_target_args(next(x for x in TESTED_LINES if x.bridge == sys.argv[2]))))
    elif len(sys.argv) == 2 and sys.argv[1] == "lines":
        print(" ".join(x.bridge for x in TESTED_LINES))
    else:
        sys.exit("usage: python -m rpb.integrations.megatron.versions pip-args BRIDGE | lines")
