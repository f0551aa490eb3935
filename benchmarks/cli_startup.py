"""How long the command line takes to start: ``rpb collect --help`` (a core command: its parser built, the toy
world's commands registered, nothing run) against ``rpb experiment --help``, which lists the shipped grids and so
imports the whole toy world, as building the command line did for every command before the grids were listed
lazily; and against a bare ``import torch``, the floor any command pays.

Each command is a fresh interpreter, the three alternating, medians of ``--repeats``. The last line printed is one
JSON object: seconds per command and ``ratio`` (collect / experiment).

``--smoke`` starts each command once, without the file-cache warm-up: a check that the script runs, not a
measurement.

Run: .venv/bin/python benchmarks/cli_startup.py [--repeats 5] [--smoke]
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import time

COMMANDS = {
    "collect_help": [sys.executable, "-m", "rpb", "collect", "--help"],
    "experiment_help": [sys.executable, "-m", "rpb", "experiment", "--help"],
    "import_torch": [sys.executable, "-c", "import torch"],
}


def seconds(cmd: list[str]) -> float:
    started = time.perf_counter()
    subprocess.run(cmd, check=True, capture_output=True)
    return time.perf_counter() - started


#: --smoke: each command once (an option given explicitly still wins)
SMOKE = dict(repeats=1)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--smoke", action="store_true", help="each command once, no warm-up")
    args = p.parse_args(argv)
    if args.smoke:  # again, on the smoke defaults: an option given explicitly still wins
        p.set_defaults(**SMOKE)
        args = p.parse_args(argv)
    return args


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    for cmd in COMMANDS.values() if not args.smoke else ():  # warm the file cache once
        seconds(cmd)
    times: dict[str, list[float]] = {name: [] for name in COMMANDS}
    for _ in range(args.repeats):
        for name, cmd in COMMANDS.items():
            times[name].append(seconds(cmd))
    medians = {name: round(statistics.median(t), 3) for name, t in times.items()}
    for name, t in times.items():
        print(f"{name}: median {medians[name]:.2f} s of {', '.join(f'{x:.2f}' for x in t)}")
    smoke = {"smoke": True} if args.smoke else {}  # a smoke run's figures are no measurement
    print(json.dumps({**medians, "ratio": round(medians["collect_help"] / medians["experiment_help"], 3), **smoke}))


if __name__ == "__main__":
    main()
