"""What a routing target costs per step: ``routing-kd`` with ``anchor.target`` against the same step at a fixed λ,
on the toy world's shipped base 0 with the grids' recipe (teacher_overhead.py's set-up: batch 32, max_seq_len 96,
packed batches, rpb's experts kernel, a frozen copy as the online base).

Both runs measure the step's overlap (every ``routing-kd`` run logs ``anchor/overlap``) and run the monitor (on by
default under ``routing-kd``); the target adds the controller's update at each step's end and a λ that changes the
term's scale. Rounds alternate the order (target, fixed, fixed, target, ...); step i of one round's target run is
paired with step i of the same round's fixed run, and the figure is the median of those pairs' ratios (target
<= 1.03, at least 30 pairs). For context, the monitor's share of the step: the fixed-λ step with the monitor on
(its default) / off (``monitor_on_vs_off``).

The exit status is 0 whether the target holds or not; the last line printed is one JSON object.

``--smoke`` takes one step of each on batches of 4 rows and judges no target: a check that the script runs.

Run: .venv/bin/python benchmarks/target_overhead.py [--steps 10 --warmup 2 --rounds 4 --threads 2] [--smoke]
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from rpb.monitor.routing import MonitorConfig
from rpb.toyworld.world.post import PostRecipe, write_rows
from rpb.toyworld.world.tasks import sample
from teacher_overhead import sft_config, sft_step_times

TARGET = 1.03
#: the overlap the target run holds: below what a fixed λ of 0.1 keeps over these steps, so λ moves every step
HOLD = 0.99
SMOKE = dict(steps=1, warmup=0, rounds=1)
SMOKE_BATCH_SIZE = 4


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--steps", type=int, default=10, help="timed steps per variant and round")
    p.add_argument("--warmup", type=int, default=2, help="steps left out at the start of each run")
    p.add_argument("--rounds", type=int, default=4)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--smoke", action="store_true", help="one step of each on small batches, no target judged")
    args = p.parse_args(argv)
    if args.smoke:  # again, on the smoke defaults: an option given explicitly still wins
        p.set_defaults(**SMOKE)
        args = p.parse_args(argv)
    return args


def main(argv: list[str] | None = None) -> None:
    a = parse_args(argv)
    torch.set_num_threads(a.threads)
    tmp = Path(tempfile.mkdtemp(prefix="target-overhead-"))
    batch = SMOKE_BATCH_SIZE if a.smoke else PostRecipe().batch_size
    n = a.steps + a.warmup
    data = write_rows(sample("math_post", batch * n, seed=0), tmp / "math_post.jsonl")

    def run(name: str, out: Path) -> list[float]:
        anchor = {"lambda_": 0.1} | ({"target": HOLD} if name == "target" else {})
        cfg = sft_config(out, data, n, "routing-kd", False, anchor, batch)
        cfg.monitor = MonitorConfig(enabled=name != "fixed_no_monitor")
        return sft_step_times(cfg, a.warmup)

    order = ["target", "fixed", "fixed_no_monitor"]
    pairs: dict[str, list[float]] = {"target": [], "monitor_on_vs_off": []}
    medians: dict[str, list[float]] = {k: [] for k in order}
    for r in range(a.rounds):
        times = {name: run(name, tmp / f"{name}-{r}") for name in (order if r % 2 == 0 else order[::-1])}
        pairs["target"] += [t / f for t, f in zip(times["target"], times["fixed"], strict=True)]
        pairs["monitor_on_vs_off"] += [t / f for t, f in zip(times["fixed"], times["fixed_no_monitor"], strict=True)]
        for name, seconds in times.items():
            medians[name] += seconds
    ratios = {k: statistics.median(v) for k, v in pairs.items()}
    judged = not a.smoke
    print(f"target / fixed: {ratios['target']:.3f} ({f'target <= {TARGET}' if judged else '--smoke: none judged'})")
    print(f"monitor on / off, fixed λ: {ratios['monitor_on_vs_off']:.3f} (context)")
    print(json.dumps({"ratio": round(ratios["target"], 4), "monitor_on_vs_off": round(ratios["monitor_on_vs_off"], 4),
                      "pairs": len(pairs["target"]), "target": TARGET if judged else None,
                      "holds": ratios["target"] <= TARGET if judged else None, "threads": a.threads,
                      "median_step_seconds": {k: round(statistics.median(v), 4) for k, v in medians.items()},
                      **({"smoke": True} if a.smoke else {})}))  # fmt: skip


if __name__ == "__main__":
    main()
