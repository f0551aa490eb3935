"""The jobs tests/toyworld/study/test_lanes.py runs in lanes, in a module of their own: a lane is a spawned process
that imports the module its job lives in, and the test module imports the whole toy world (seconds per lane)."""

from __future__ import annotations

import json
import os
import time
from pathlib import Path

import torch


def stamp(folder: str, name: str, seconds: float) -> str:
    """Sleep, then leave ``name``'s start and end times, the process and its torch thread count."""
    started = time.time()
    time.sleep(seconds)
    record = {"start": started, "end": time.time(), "pid": os.getpid(), "threads": torch.get_num_threads()}
    Path(folder, name).write_text(json.dumps(record))
    return name


def meet(folder: str, name: str, partner: str, patience: float = 60.0) -> str:
    """Say ``name`` started, wait (up to ``patience`` seconds) for ``partner`` to say so too, then leave the record
    ``stamp`` leaves, with whether the two met: they did only if they ran at once, whatever the machine's load."""
    started = time.time()
    Path(folder, f"{name}.started").write_text("")
    while not (met := Path(folder, f"{partner}.started").is_file()) and time.time() - started < patience:
        time.sleep(0.01)
    record = {"start": started, "end": time.time(), "pid": os.getpid(), "threads": torch.get_num_threads(), "met": met}
    Path(folder, name).write_text(json.dumps(record))
    return name


def fail(message: str) -> None:
    raise ValueError(message)


def die() -> None:
    os._exit(3)
