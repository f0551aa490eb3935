"""Several toy-world jobs at once: ``lanes`` processes side by side, each with its own intra-op threads.

The toy model's products are too small for a second thread to pay for itself: on 2 cores, two post-training
cells side by side at one thread each finish 1.4x sooner than one after the other at two threads
(docs/performance.md). A job is a call (a study's prior, calibration, cell, ...) with the jobs it waits for;
every job writes its own files atomically, so the processes share nothing but the folders. ``lanes=1`` runs
the jobs here, in order, as the study always did.

A cell's bits follow its thread count (the kernels' summation order), which each cell records.
"""

from __future__ import annotations

import multiprocessing
import os
from collections.abc import Callable, Sequence
from concurrent.futures import FIRST_COMPLETED, ProcessPoolExecutor, wait
from concurrent.futures.process import BrokenProcessPool
from dataclasses import dataclass, field
from typing import Any

from rpb.errors import RpbError


@dataclass(frozen=True)
class Job:
    """``fn(*args)`` once every job in ``after`` (indices of earlier jobs) has finished."""

    fn: Callable[..., Any]
    args: tuple = ()
    after: tuple[int, ...] = ()
    label: str = ""
    #: counted by ``on_done`` (a grid's runs; not its prior or calibration)
    counted: bool = field(default=False, compare=False)


BROKEN = (
    "its process ended abruptly: killed, out of memory, or started from a script without an "
    '`if __name__ == "__main__":` guard (the lanes\' processes import the script that starts them)'
)


class JobsFailedError(RpbError):
    """One or more jobs raised; the jobs that finished kept their files."""


def usable_cores() -> int:
    """The cores this process may run on (its affinity), not the machine's count."""
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # not on Linux
        return os.cpu_count() or 1


#: ``default_lanes``' ceiling: each lane is a whole process (its own torch, model and data, about 1 GB)
MAX_DEFAULT_LANES = 8


def default_lanes() -> int:
    """One lane per usable core (one thread each), at most ``MAX_DEFAULT_LANES``."""
    return min(usable_cores(), MAX_DEFAULT_LANES)


def lane_threads(lanes: int) -> int:
    """Intra-op threads per lane: the usable cores shared out, at least one."""
    return max(1, usable_cores() // max(lanes, 1))


def _start_lane(threads: int) -> None:
    import torch
    from transformers.utils import logging as hf_logging

    torch.set_num_threads(threads)
    hf_logging.disable_progress_bar()  # a lane's load/save bars would interleave with the others'


def _call(job: Job):
    return job.fn(*job.args)


def run_jobs(jobs: Sequence[Job], lanes: int = 1, on_done: Callable[[Job], None] | None = None) -> list:
    """Every job's return value, in order. Among the jobs whose waits are over, the earliest listed starts
    first. A job that raises stops new starts; the running ones finish, then every failure is raised at once."""
    for i, job in enumerate(jobs):
        if any(not 0 <= a < i for a in job.after):
            raise ValueError(f"job {i} ({job.label}) waits for {job.after}: only earlier jobs can be waited for")
    done = on_done or (lambda job: None)
    if lanes <= 1 or len(jobs) <= 1:
        results = []
        for job in jobs:
            results.append(_call(job))
            done(job)
        return results
    lanes = min(lanes, len(jobs))
    results: dict[int, Any] = {}
    failures: list[str] = []
    first: BaseException | None = None  # chained to the report: its lane's traceback comes with it
    pending, running = list(range(len(jobs))), {}  # running: Future -> index
    context = multiprocessing.get_context("spawn")  # a fork would copy this process's threads and locks
    with ProcessPoolExecutor(
        lanes, mp_context=context, initializer=_start_lane, initargs=(lane_threads(lanes),)
    ) as pool:
        while running or (pending and not failures):
            ready = [i for i in pending if all(a in results for a in jobs[i].after)] if not failures else []
            for i in ready[: lanes - len(running)]:
                pending.remove(i)
                running[pool.submit(_call, jobs[i])] = i
            if not running:  # nothing can start: a wait on a job that failed
                break
            finished, _ = wait(running, return_when=FIRST_COMPLETED)
            for future in finished:
                i = running.pop(future)
                if (error := future.exception()) is not None:
                    why = BROKEN if isinstance(error, BrokenProcessPool) else f"{type(error).__name__}: {error}"
                    failures.append(f"{jobs[i].label or i}: {why}")
                    first = first or error
                else:
                    results[i] = future.result()
                    done(jobs[i])
    if failures:
        not_run = len(jobs) - len(results) - len(failures)
        raise JobsFailedError(
            f"{len(failures)} job(s) failed ({not_run} not run; the {len(results)} finished "
            "kept their files):\n" + "\n".join(failures)
        ) from first
    return [results[i] for i in range(len(jobs))]
