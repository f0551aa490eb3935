"""A pytest plugin the harness loads into every mutant's run: the rpb under test must be the scratch copy's.

An editable install of the original would otherwise be imported first and every mutant would "survive".
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest

#: pytest's exit status for a run the guard stops (the harness reads it as a harness error)
GUARD_EXIT = 7


def pytest_configure(config):
    import rpb

    scratch = Path(os.environ["RPB_MUTANT_SCRATCH"]).resolve()
    where = Path(rpb.__file__).resolve()
    if scratch not in where.parents:
        pytest.exit(f"rpb imported from {where}, not from the scratch copy {scratch}", returncode=GUARD_EXIT)
