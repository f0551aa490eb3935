"""How long a shipped grid's report takes to make again, with the two-stage bootstrap drawing every seed in one
numpy call (``rpb.toyworld.study.stats.two_stage_bootstrap``) against drawing one base's seeds at a time, the way
it was first written and the shipped reports were made.

Both draw the same numbers from the same generator (tests/toyworld/study/test_stats.py checks it bit for bit); this
measures the report made from a copy of ``docs/results/<grid>`` (the ``full`` grid by default) under each,
alternating, and checks both give the shipped tables. The last line printed is one JSON object: ``report_s`` per
draw (median), ``speedup`` (one at a time / in one call), ``same_tables``.

``--smoke`` makes the headline grid's report once under each: a check that the script runs, not a measurement.

Run: .venv/bin/python benchmarks/report_bootstrap.py [--grid full --repeats 3] [--smoke]
"""

from __future__ import annotations

import argparse
import json
import shutil
import statistics
import tempfile
import time
from pathlib import Path

import numpy as np

from rpb.toyworld.grids import find
from rpb.toyworld.study import across, stats
from rpb.toyworld.study.shipping import report_shipped

RESULTS = Path(__file__).resolve().parents[1] / "docs" / "results"
#: --smoke: one report under each draw, of a smaller grid (an option given explicitly still wins)
SMOKE = dict(grid="headline", repeats=1)


def one_at_a_time(diffs: dict[int, list[float]], resamples: int = stats.RESAMPLES, seed: int = stats.BOOTSTRAP_SEED):
    """The bootstrap as first written: numpy's draws one base at a time."""
    rng = np.random.default_rng(seed)
    per_base = [np.asarray(v, dtype=float) for _, v in sorted(diffs.items())]
    if not per_base:
        return np.array([])
    drawn = rng.integers(len(per_base), size=(resamples, len(per_base)))
    means = np.empty(resamples)
    for i, bases in enumerate(drawn):
        means[i] = np.concatenate(
            [per_base[b][rng.integers(len(per_base[b]), size=len(per_base[b]))] for b in bases]
        ).mean()
    return means


def timed(grid: str, draw) -> tuple[float, bool]:
    """Seconds to make the grid's report from a copy of its shipped cells with ``draw``, and whether its tables are
    the shipped ones."""
    stats.two_stage_bootstrap = across.two_stage_bootstrap = draw
    with tempfile.TemporaryDirectory() as tmp:
        copy = Path(tmp) / grid
        shutil.copytree(RESULTS / grid, copy)
        started = time.perf_counter()
        report_shipped(find(grid), copy)
        seconds = time.perf_counter() - started
        return seconds, (copy / "tables.md").read_text() == (RESULTS / grid / "tables.md").read_text()


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--grid", default="full", help="a shipped grid with the paper's report (headline, beta, full)")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--smoke", action="store_true", help="the headline grid's report once under each")
    args = p.parse_args(argv)
    if args.smoke:  # again, on the smoke defaults: an option given explicitly still wins
        p.set_defaults(**SMOKE)
        args = p.parse_args(argv)
    return args


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    draws = {"one_call": stats.two_stage_bootstrap, "one_at_a_time": one_at_a_time}
    seconds: dict[str, list[float]] = {name: [] for name in draws}
    same = True
    for _ in range(args.repeats):
        for name, draw in draws.items():
            s, ok = timed(args.grid, draw)
            seconds[name].append(s)
            same &= ok
            print(f"{name}: {s:.2f} s, tables {'as shipped' if ok else 'DIFFER'}", flush=True)
    median = {name: statistics.median(v) for name, v in seconds.items()}
    print(
        json.dumps(
            {
                "grid": args.grid,
                "report_s": {k: round(v, 3) for k, v in median.items()},
                "speedup": round(median["one_at_a_time"] / median["one_call"], 1),
                "same_tables": same,
                **({"smoke": True} if args.smoke else {}),  # a smoke run's figures are no measurement
            }
        )
    )


if __name__ == "__main__":
    main()
