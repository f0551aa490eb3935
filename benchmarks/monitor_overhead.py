"""Training-step overhead of the routing monitor (rpb.monitor), on train_overhead.py's Moonlight-shaped MoE.

Two deep copies of one model, each with its own AdamW, take full SFT steps on the same synthetic batches
(``model(**batch).loss.backward(); optimizer.step()``): one plain, one with ``RoutingMonitor`` attached and
flushed every step as a logging callback would. Timed three ways, alternating the order every round: plain,
monitored every step (``every_n_steps: 1``), monitored one step in ten (``every_n_steps: 10``). Per variant
the median step time; ``ratio`` = median(every step) / median(plain), ``ratio_every_10`` likewise. Targets:
``ratio`` <= 1.05, ``ratio_every_10`` <= 1.02 (the exit status is 0 either way). The last line printed is one
JSON object.

``--smoke`` takes one step of each on train_overhead.py's tiny shape and judges no target: a check that the
script runs, not a measurement.

Run: .venv/bin/python benchmarks/monitor_overhead.py [--steps 30 --warmup 3 --threads 2] [--smoke]
"""

from __future__ import annotations

import argparse
import copy
import json
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).parent))
from rpb.monitor import MonitorConfig, RoutingMonitor
from train_overhead import build_model, synthetic_batch

TARGETS = {"ratio": 1.05, "ratio_every_10": 1.02}


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    """train_overhead.py's options, --smoke included (its --methods and anchor options are ignored here)."""
    import train_overhead

    return train_overhead.parse_args(argv)


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    base = build_model(args)
    variants = {}
    for name, every in (("plain", None), ("every_step", 1), ("every_10", 10)):
        model = copy.deepcopy(base)
        monitor = RoutingMonitor(model, MonitorConfig(every_n_steps=every)).attach() if every else None
        variants[name] = (model, torch.optim.AdamW(model.parameters(), lr=1e-5), monitor, every)
    gen = torch.Generator().manual_seed(args.seed)
    times: dict[str, list[float]] = {name: [] for name in variants}
    order = list(variants)
    last: dict[str, dict] = {}
    for step in range(args.warmup + args.steps):
        batch, _ = synthetic_batch(args, gen)
        for name in order:
            model, optimizer, monitor, every = variants[name]
            start = time.perf_counter()
            if monitor is not None:
                monitor.active = step % every == 0
            model(**batch).loss.backward()
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
            if monitor is not None:
                figures = monitor.flush()  # what the callback does at every log
                last[name] = figures or last.get(name, {})
            if step >= args.warmup:
                times[name].append(time.perf_counter() - start)
        order = order[1:] + order[:1]
    median = {name: statistics.median(t) for name, t in times.items()}
    out = {"ratio": median["every_step"] / median["plain"], "ratio_every_10": median["every_10"] / median["plain"],
           "_median_ms": {k: round(v * 1e3, 1) for k, v in median.items()}, "_targets": {} if args.smoke else TARGETS,
           "_steps": args.steps, "_figures_logged": {k: len(v) for k, v in last.items()}}  # fmt: skip
    out |= {"_smoke": True} if args.smoke else {}  # a smoke run's figures are no measurement
    if not all(last.get(name) for name in ("every_step", "every_10")):
        raise SystemExit("the monitor logged no figures: it measured nothing")
    for key, target in TARGETS.items():
        print(f"{key}: {out[key]:.3f}" + (" (--smoke: no target judged)" if args.smoke else f" (target <= {target})"))
    print(json.dumps(out))


if __name__ == "__main__":
    main()
