"""The benchmark scripts keep working as the library moves (a measurement takes minutes; the suite runs only smoke).

The four that time training steps run end to end here, in this process, at ``--smoke`` (a tiny shape, one step,
no target judged): each prints as its last line the JSON object it promises. Every other script is imported and
must offer ``--smoke`` to its argument parser; they start processes or read the toy world's pools and the shipped
grids, seconds to minutes even at their smallest. A script in benchmarks/ on neither list fails a test, so a new
benchmark cannot be left out.
"""

from __future__ import annotations

import importlib.util
import json
import math
import sys
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import NamedTuple

import pytest

from rpb.anchors import METHODS

BENCHMARKS = Path(__file__).resolve().parents[2] / "benchmarks"


class Smoke(NamedTuple):
    """A benchmark run at --smoke, and how to read its last line."""

    options: list[str]  # beside --smoke
    promised: set[str]  # keys its last line always holds
    ratios: Callable[[dict], dict]  # its figures that are ratios
    verdicts: Callable[[dict], dict]  # the targets it judged (none at --smoke)
    marked: Callable[[dict], object]  # its smoke mark


def _no_underscore(figures: dict) -> dict:
    return {k: v for k, v in figures.items() if not k.startswith("_")}


RUN = {
    "train_overhead": Smoke(
        [],
        {"sft", "rpb", "kl-to-base", "logit-l2", "_shape", "_median_ms", "_targets"},
        _no_underscore,
        lambda f: f["_targets"],
        lambda f: f["_shape"].get("smoke"),
    ),
    "teacher_overhead": Smoke(
        ["--threads", "1"],  # its default, 2, would stay set in this process
        {"median_step_seconds", "ratios", "targets_met", "threads", "steps_per_variant"},
        lambda f: f["ratios"],
        lambda f: f["targets_met"],
        lambda f: f.get("smoke"),
    ),
    "monitor_overhead": Smoke(
        [],
        {"ratio", "ratio_every_10", "_median_ms", "_targets", "_steps", "_figures_logged"},
        lambda f: {k: f[k] for k in ("ratio", "ratio_every_10")},
        lambda f: f["_targets"],
        lambda f: f.get("_smoke"),
    ),
    "target_overhead": Smoke(
        ["--threads", "1"],
        {"ratio", "monitor_on_vs_off", "pairs", "target", "holds", "threads", "median_step_seconds"},
        lambda f: {k: f[k] for k in ("ratio", "monitor_on_vs_off")},
        lambda f: {k: f[k] for k in ("target", "holds") if f[k] is not None},
        lambda f: f.get("smoke"),
    ),
    "replay_overhead": Smoke(
        ["--threads", "1"],
        {"ratio", "pr2_ratio", "ratio_vs_plain", "off_vs_plain", "generation_ratio", "holds", "pr2_holds"},
        lambda f: {k: f[k] for k in ("ratio", "pr2_ratio", "ratio_vs_plain", "off_vs_plain", "generation_ratio")},
        lambda f: {k: f[k] for k in ("holds", "pr2_holds", "target", "pr2_target") if f[k] is not None},
        lambda f: f.get("smoke"),
    ),
}
#: imported only: each starts processes (cli_startup, collect_memory, toyworld_speed's lanes), or reads a
#: toy-world pool or a shipped grid, or builds and saves its checkpoints first
IMPORT_ONLY = (
    "calibrate_cost",
    "cli_startup",
    "collect_memory",
    "collect_throughput",
    "report_bootstrap",
    "retention_scaling",
    "retention_transitions",
    "route_memory",
    "routes_throughput",
    "term_scale",
    "toyworld_profile",
    "toyworld_speed",
)
#: train_overhead's methods: all but those whose term reads the base's forward on every batch
TIMED_METHODS = {name for name, method in METHODS.items() if method.teacher is None}


def load(name: str):
    spec = importlib.util.spec_from_file_location(f"benchmark_{name}", BENCHMARKS / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)  # imports only: each script runs under `if __name__ == "__main__"`
    return module


@pytest.fixture
def isolated(monkeypatch, tmp_path):
    """What a script leaves behind stays in the test: its temporary folders (teacher_overhead keeps its own)
    under tmp_path, and monitor_overhead's entry for benchmarks/ on sys.path undone."""
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    monkeypatch.setattr(sys, "path", [*sys.path])


def last_json(out: str) -> dict:
    figures = json.loads(out.strip().splitlines()[-1])
    assert isinstance(figures, dict)
    return figures


def test_every_benchmark_is_run_or_imported():
    assert not set(RUN) & set(IMPORT_ONLY)
    assert {p.stem for p in BENCHMARKS.glob("*.py")} == set(RUN) | set(IMPORT_ONLY)


@pytest.mark.parametrize("name", RUN)
def test_a_training_loop_benchmark_runs_at_smoke(name, isolated, one_thread, capsys):
    smoke = RUN[name]
    load(name).main([*smoke.options, "--smoke"])
    figures = last_json(capsys.readouterr().out)
    assert smoke.promised <= figures.keys()
    ratios = smoke.ratios(figures)
    assert ratios and all(math.isfinite(v) and v > 0 for v in ratios.values()), ratios
    # a smoke run says so, and judges no target on figures of one step
    assert smoke.marked(figures) is True
    assert smoke.verdicts(figures) == {}
    if name == "train_overhead":  # every method it can time, and only those
        assert set(ratios) == TIMED_METHODS
    if name == "teacher_overhead":
        assert set(ratios) == {"lora", "frozen_copy", "stored", "grpo", "grpo_vs_kl_to_base"}


@pytest.mark.parametrize("method", [name for name in METHODS if name not in TIMED_METHODS])
def test_train_overhead_refuses_a_method_that_reads_the_base_and_names_where_it_is_timed(method, capsys):
    # its loop runs no forward of the base: such a method would fail at its first step
    with pytest.raises(SystemExit) as exit_:
        load("train_overhead").main(["--smoke", "--methods", f"sft,{method}"])
    assert exit_.value.code == 2
    err = capsys.readouterr().err
    assert method in err and "base's forward" in err and "benchmarks/teacher_overhead.py" in err


@pytest.mark.parametrize("name", IMPORT_ONLY)
def test_an_imported_benchmark_offers_smoke(name, capsys):
    module = load(name)
    # main passes its argv to the parser: --help answers before any work, and lists --smoke
    with pytest.raises(SystemExit) as exit_:
        module.main(["--help"])
    assert exit_.value.code == 0
    assert "--smoke" in capsys.readouterr().out
