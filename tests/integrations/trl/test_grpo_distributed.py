"""rpb's GRPOTrainer on two gloo processes (torchrun) against one process over the same rollouts: R3,
``kl-to-base`` and the routing monitor, learning rate 0, greedy float32 generation (tests/workers/grpo_worker.py).
Every rank replays its own rows' routes (checked against its own micro-batches by a hook of its own), and the
logged figures, reduced over the ranks and weighted by their tokens, are the one process's. With PR2, each rank
replays its own rows' predicted routes, and the predictor's gradients the optimizer step takes are the one
process's on every rank."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
import torch

from tests.train.test_run_distributed import TORCHRUN, run

WORKER = Path(__file__).resolve().parents[2] / "workers" / "grpo_worker.py"


@pytest.fixture(scope="module")
def launched(tmp_path_factory) -> list:
    """One launch on one process and one on two (torchrun), each running R3 then PR2: (folder, the launch) each."""
    one, two = tmp_path_factory.mktemp("one"), tmp_path_factory.mktemp("two")
    return [(one, run([sys.executable, str(WORKER), str(one)], check=False)),
            (two, run([*TORCHRUN, str(WORKER), str(two)], check=False))]  # fmt: skip


def folders(launched, mode: str) -> tuple[Path, Path]:
    """The one-process and two-process folders of ``mode``; a launch that failed fails each test that reads it (in
    the test, not in the fixture: a failing fixture reads as an error, not as a failed check)."""
    for _, done in launched:
        assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    return tuple(folder / mode for folder, _ in launched)


def test_two_processes_replay_their_own_rows_and_log_what_one_process_logs(launched):
    one, two = folders(launched, "R3")
    single = json.loads((one / "rank0.json").read_text())
    ranks = [json.loads((two / f"rank{r}.json").read_text()) for r in (0, 1)]
    assert [r["world"] for r in ranks] == [2, 2] and single["world"] == 1
    # each rank checked its own half of the rollouts' routed positions, and every one was replayed as recorded
    assert all(r["checked"] > 0 and r["differed"] == 0 for r in ranks) and single["differed"] == 0
    assert sum(r["checked"] for r in ranks) == single["checked"]
    logs = [[h for h in run_["log_history"] if "loss" in h] for run_ in (single, ranks[0])]
    assert len(logs[0]) == len(logs[1]) == 2
    for step_one, step_two in zip(*logs, strict=True):
        figures = {k for k in step_one if k.startswith(("routing/", "anchor/"))}
        # the worker replays with R3, which logs the choices it overrides (docs/rl.md)
        assert {"routing/rollout_override_rate", "routing/mean/topk_overlap", "routing/mean/load_cv"} <= figures or (
            "routing/stale_mismatch" in figures
        )
        assert figures == {k for k in step_two if k.startswith(("routing/", "anchor/"))}
        for key in figures:
            assert abs(step_one[key] - step_two[key]) <= 1e-6, key


def test_pr2_on_two_processes_takes_the_one_processs_predictor_step(launched):
    one, two = folders(launched, "PR2")
    single = json.loads((one / "rank0.json").read_text())
    ranks = [json.loads((two / f"rank{r}.json").read_text()) for r in (0, 1)]
    assert all(r["checked"] > 0 and r["differed"] == 0 for r in ranks) and single["differed"] == 0
    # step 0 is a batch's first update (no predictor loss, no gradient); step 1 its second
    assert [g is None for g in single["grads"][0]] == [True] * len(single["grads"][0])
    want = [torch.tensor(g) for g in single["grads"][1]]
    assert all(w.abs().max() > 1e-6 for w in want), "a vanishing gradient would tell nothing"
    for r in ranks:
        for got, w in zip(r["grads"][1], want, strict=True):
            torch.testing.assert_close(torch.tensor(got), w, rtol=1e-5, atol=1e-7)
