"""Shared fixtures: locally built tokenizers, tiny saved checkpoints, JSONL writers."""

from __future__ import annotations

import os

# nothing is downloaded at run time: a hub id the tests name (as the README does) must fail at once,
# not after the hub client's network retries (read when huggingface_hub is first imported, so first)
os.environ["HF_HUB_OFFLINE"] = "1"
# under pytest-xdist (`make test` runs two workers on two cores) each worker computes at one thread, its
# subprocesses too, and keeps a toy-world cache of its own: two workers never write one cache entry at once
if os.environ.get("PYTEST_XDIST_WORKER"):
    import tempfile

    os.environ["OMP_NUM_THREADS"] = "1"
    os.environ["RPB_CACHE"] = tempfile.mkdtemp(prefix=f"rpb-cache-{os.environ['PYTEST_XDIST_WORKER']}-")

import gc
import json
from pathlib import Path

import pytest
import torch

if os.environ.get("PYTEST_XDIST_WORKER"):
    torch.set_num_threads(1)

from rpb.testing.models import build_tiny_model
from rpb.testing.tokenizers import moonlight_tokenizer
from tests.extra_tokenizers import CharSlowTokenizer, chatml_tokenizer

ROOT = Path(__file__).resolve().parents[1]
#: test files whose session fixture is too costly to build on both workers (a miniature grid run to the end):
#: under ``make test`` (pytest-xdist, ``--dist loadfile``) each group runs on one worker; every other file is a
#: group of its own
SHARED_FIXTURES = {
    "rl_finished": (
        "toyworld/study/test_rl.py",
        "toyworld/study/test_rl_report.py",
        "toyworld/study/test_rl_figures.py",
    ),
    "revert_finished": ("toyworld/grids/test_revert_study.py", "toyworld/grids/test_revert_report.py"),
}


def xdist_group_of(path: Path) -> str:
    """The worker group of a test file: its shared fixture's, else the file itself."""
    rel = path.resolve().relative_to(ROOT / "tests").as_posix()
    return next((name for name, files in SHARED_FIXTURES.items() if rel in files), rel)


#: the units that take longest (``pytest --durations=0`` on 2 cores, 2026-12-06: 950 s of tests in 499 s), started
#: first so that no long unit begins when the other worker is nearly done: longest first is the classic cure for a
#: long tail. A unit not listed follows in file order; a stale entry costs balance only (a test checks that each
#: one still names a unit)
SLOW_FIRST = (
    "adapters/test_hf_replicas.py",
    "project/test_family_matrix.py",
    "train/test_run.py",
    "integrations/axolotl/test_plugin.py",
    "train/test_run_distributed.py",
    "train/test_checkpoints.py",
    "integrations/trl/test_sft.py",
    "toyworld/study/test_lanes.py",
    "collect/test_collector.py",
    "integrations/trl/test_generation_paths.py",
    "test_fileio_kills.py",
    "rl_finished",
    "project/test_mutants.py",
    "toyworld/study/test_cells_cot.py",
    "integrations/megatron/test_bridge_lines.py",
    "toyworld/study/test_cells.py",
    "project/test_structure.py",
    "integrations/trl/test_grpo.py",
    "toyworld/study/test_across.py",
)


def scope_of(nodeid: str) -> str:
    """The unit of work a test goes to a worker in: its file's group."""
    return xdist_group_of(ROOT / nodeid.split("::", 1)[0])


# The groups are made by the scheduler, not by ``xdist_group`` marks: xdist 3.8 renames a marked test by assigning
# ``item._nodeid``, which pytest 9.2's node ids no longer read, so under ``--dist loadgroup`` every test went to a
# worker alone and each file's module fixtures (and the shared ones) were built on both workers.
@pytest.hookimpl(tryfirst=True)
def pytest_xdist_make_scheduler(config, log):
    if config.getvalue("dist") != "loadfile":
        return None
    from xdist.scheduler import LoadScopeScheduling

    config.option.loadscopereorder = False  # the units go in collection order: SLOW_FIRST's, then the rest

    class FileGroups(LoadScopeScheduling):
        """``--dist loadfile``, with the files of one shared fixture in one unit."""

        def _split_scope(self, nodeid: str) -> str:
            return scope_of(nodeid)

    return FileGroups(config, log)


def pytest_collection_finish(session):
    """Everything alive once the tests are collected (torch, transformers, the toy world, the test modules) is
    frozen out of the garbage collector's view: a full collection otherwise walks all of it, and transformers'
    Trainer runs one at the end of every ``train()`` (accelerate's ``free_memory``), rpb's ``run_training``
    another: 0.5 s of a 0.7 s tiny run, 0.15 s frozen (``gc.freeze``, CPython's own tool for long-lived heaps)."""
    gc.freeze()


def pytest_collection_modifyitems(config, items):
    """On an xdist worker, the tests of ``SLOW_FIRST``'s units first (a stable sort: each file keeps its order)."""
    if os.environ.get("PYTEST_XDIST_WORKER"):
        rank = {unit: i for i, unit in enumerate(SLOW_FIRST)}
        items.sort(key=lambda item: rank.get(scope_of(item.nodeid), len(SLOW_FIRST)))


@pytest.fixture(scope="session")
def moon_tok():
    return moonlight_tokenizer()


@pytest.fixture(scope="session")
def chatml_tok():
    return chatml_tokenizer()


@pytest.fixture(scope="session")
def slow_tok():
    return CharSlowTokenizer()


@pytest.fixture(scope="module")
def one_thread():
    """Tiny tensors: one intra-op thread avoids synchronisation overhead on a shared CPU."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def write_rows(path: Path, rows: list) -> Path:
    """Rows may be dicts (dumped as JSON) or raw strings (written as they are)."""
    with open(path, "w", encoding="utf-8") as f:
        for row in rows:
            f.write((row if isinstance(row, str) else json.dumps(row)) + "\n")
    return path


def with_tensors_changed(model_dir: Path, out: Path, change) -> Path:
    """A copy of a single-file checkpoint whose tensors ``change(tensors)`` edited in place (other files copied)."""
    from safetensors.torch import load_file, save_file

    tensors = load_file(model_dir / "model.safetensors")
    change(tensors)
    out.mkdir()
    for f in model_dir.iterdir():
        if f.name != "model.safetensors":
            (out / f.name).write_bytes(f.read_bytes())
    save_file(tensors, str(out / "model.safetensors"), metadata={"format": "pt"})
    return out


def coefficient_overrides(method: str, lambda_: float, lbl_coef: float) -> list[str]:
    """The ``anchor.lambda`` / ``anchor.lbl_coef`` override of whichever coefficient ``method`` reads (none for a
    method that reads neither: a coefficient it does not read is refused)."""
    from rpb.anchors import METHODS

    read = METHODS[method].coefficient
    return {"lambda_": [f"anchor.lambda={lambda_}"], "lbl_coef": [f"anchor.lbl_coef={lbl_coef}"]}.get(read, [])


def qa(question: str, answer: str) -> dict:
    return {"messages": [{"role": "user", "content": question}, {"role": "assistant", "content": answer}]}


@pytest.fixture(scope="session")
def save_tiny(tmp_path_factory, moon_tok):
    """save_tiny(arch, seed=0, **config_overrides) -> directory holding a tiny model of ``arch`` and the
    Moonlight tokenizer (overrides such as ``attention_dropout=0.1`` change the config, not the weights)."""
    cache: dict = {}

    def make(arch: str, seed: int = 0, **overrides) -> Path:
        key = (arch, seed, *sorted(overrides.items()))
        if key not in cache:
            out = tmp_path_factory.mktemp(f"{arch}-{seed}")
            build_tiny_model(arch, vocab_size=len(moon_tok), seed=seed, **overrides).save_pretrained(out)
            moon_tok.save_pretrained(out)
            cache[key] = out
        return cache[key]

    return make


@pytest.fixture(scope="session")
def replica(tmp_path_factory):
    """replica(name) -> a saved tiny replica of a shipped checkpoint with its vendor's chat template
    (``rpb.testing.replica``), built once per test run."""
    from rpb.testing import replica as build

    cache = {}

    def make(name):
        if name not in cache:
            cache[name] = build(name, tmp_path_factory.mktemp(f"replica-{name}"))
        return cache[name]

    return make
