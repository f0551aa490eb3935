"""The benchmark scripts stay importable as the library moves (they run outside the suite: minutes each)."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest

BENCHMARKS = sorted((Path(__file__).resolve().parents[2] / "benchmarks").glob("*.py"))


@pytest.mark.parametrize("path", BENCHMARKS, ids=lambda p: p.stem)
def test_benchmark_imports_and_has_a_main(path):
    spec = importlib.util.spec_from_file_location(f"benchmark_{path.stem}", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)  # imports only: each script runs under `if __name__ == "__main__"`
    assert callable(module.main) and callable(module.parse_args)
