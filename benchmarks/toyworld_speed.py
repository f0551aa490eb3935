"""The toy world's fast path against its reference path: pretraining steps per second and one post-training cell.

``BaseRecipe(kernels="fast")`` (rpb's experts kernel, ``rpb.kernels.experts``, and packed rows) against
``kernels="reference"`` (transformers' default experts kernel, padded rows, as the toy world ran before), in one
run, as a ladder: each rung adds one lever to the rung before it, so each lever's effect shows.

* pretraining: steps exactly as ``rpb.toyworld.world.base.pretrain`` takes them (lbl anchor, deterministic kernels,
  AdamW, clipping) on the real pretraining pool, the same batches for every rung, median seconds per step after
  two untimed steps; the rungs alternate in rounds, so a slower stretch of the machine hits them all;
* one post-training cell: ``rpb.toyworld.world.post.train_cell`` (``rpb train``: sft, the demo's PostRecipe) on the
  math set from the same base (a freshly initialised one, saved once), wall time of the training. "Labelled
  once" is a cell after the first of its process, as every cell but one of a demo or grid is: its data file was
  labelled already (``rpb.data.load_labelled`` keeps it); the reference cell labels it, as every cell did.
  The last rung runs ``--lanes`` fast cells side by side (``rpb.toyworld.study.lanes``: one process each, the
  threads shared out), as ``rpb demo`` and ``rpb experiment`` do: wall time, from the pool's start (the
  processes' imports and labelling included) to the last cell's end, divided by the cells.

Nothing else may run meanwhile. The last line printed is one JSON object: ``pretrain_step_s`` and ``cell_s``
per rung, ``pretrain_speedup`` and ``cell_speedup`` (reference / the last rung), ``ratio`` (the smaller of the
two), the machine, the thread count and the lanes.

``--smoke`` climbs the ladder once: one pretraining step per rung on batches of 8 conversations from a pool of
128, one-step cells on 64 rows in batches of 4, one lane: a check that the script runs, not a measurement.

Run: .venv/bin/python benchmarks/toyworld_speed.py [--steps 12 --rounds 3 --post-steps 500 --threads 2 --lanes 2]
     [--smoke]
"""

from __future__ import annotations

import argparse
import contextlib
import json
import statistics
import tempfile
import time
from dataclasses import replace
from pathlib import Path
from typing import NamedTuple

import torch
from transformers import AutoModelForCausalLM

import rpb.train.run
from rpb.anchors import AnchorConfig, install_anchor
from rpb.data import load_labelled
from rpb.data.dataset import forget_labelled
from rpb.kernels import SORTED_EXPERTS, token_mask
from rpb.models import load_tokenizer
from rpb.testing.models import tiny_config
from rpb.testing.tokenizers import moonlight_tokenizer
from rpb.toyworld.study.lanes import Job, run_jobs
from rpb.toyworld.world.base import BaseRecipe, encode_tasks, machine, pretraining_step, training_batch, training_pool
from rpb.toyworld.world.post import PostRecipe, train_cell, write_rows
from rpb.toyworld.world.tasks import sample
from rpb.train.run import deterministic_algorithms

#: --smoke: one step, one round, one lane (an option given explicitly still wins), small pools and batches
SMOKE = dict(steps=1, rounds=1, post_steps=1, lanes=1)
SMOKE_BASE = dict(pool=128, batch_size=8)
SMOKE_POST = dict(train_rows=64, batch_size=4)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--steps", type=int, default=12, help="timed pretraining steps per path and round")
    p.add_argument("--rounds", type=int, default=3, help="rounds of the two paths, alternating")
    p.add_argument("--post-steps", type=int, default=500, help="steps of the post-training cell (the recipe: 500)")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--lanes", type=int, default=2, help="fast cells side by side, one process each")
    p.add_argument("--smoke", action="store_true", help="one step per rung, one-step cells, one lane")
    args = p.parse_args(argv)
    if args.smoke:  # again, on the smoke defaults: an option given explicitly still wins
        p.set_defaults(**SMOKE)
        args = p.parse_args(argv)
    return args


class Rung(NamedTuple):
    """One configuration of the ladder: each rung adds one lever to the one before it."""

    name: str
    kernels: str  # the batch layout and (pretraining) the recipe's kernels: "reference" padded, "fast" packed
    experts: str | None = None  # pretraining's experts kernel (None: transformers' default)
    token_mask: bool = False  # pretraining: rpb_sorted skips the padding
    fill: bool = False  # deterministic mode's NaN fill of new memory (rpb.train.run.FILL_UNINITIALIZED_MEMORY)
    labelled: bool = False  # post-training: the data file was labelled by an earlier cell of the process


PRETRAIN_LADDER = (
    Rung("reference", "reference", fill=True),
    Rung("+ no NaN fill of new memory", "reference"),
    Rung("+ rpb_sorted experts, padding skipped", "reference", SORTED_EXPERTS, token_mask=True),
    Rung("fast: + packed rows", "fast", SORTED_EXPERTS),
)
CELL_LADDER = (
    Rung("reference", "reference", fill=True),
    Rung("+ no NaN fill of new memory", "reference"),
    Rung("+ data labelled once per process", "reference", labelled=True),
    Rung("fast: + rpb_sorted experts, packed rows", "fast", labelled=True),
)
#: the last cell rung: ``lanes`` fast cells side by side (rpb.toyworld.study.lanes, the cores shared out),
#: wall time / lanes
LANES_RUNG = "fast, {lanes} cells side by side (wall / cells)"


@contextlib.contextmanager
def filling(on: bool):
    before, rpb.train.run.FILL_UNINITIALIZED_MEMORY = rpb.train.run.FILL_UNINITIALIZED_MEMORY, on
    try:
        yield
    finally:
        rpb.train.run.FILL_UNINITIALIZED_MEMORY = before


class Pretraining:
    """One rung's model, anchor and optimizer, stepping through the shared batches."""

    def __init__(self, recipe: BaseRecipe, rung: Rung, vocab: int):
        torch.manual_seed(recipe.seed)
        config = tiny_config("moonlight", vocab, **recipe.model_overrides())
        kernel = {"experts_implementation": rung.experts} if rung.experts else {}
        self.recipe, self.rung = replace(recipe, kernels=rung.kernels), rung
        self.model = AutoModelForCausalLM.from_config(config, **kernel)
        self.model.train()
        self.handle = install_anchor(self.model, AnchorConfig(method="lbl", lbl_coef=recipe.lbl_coef))
        self.opt = torch.optim.AdamW(self.model.parameters(), lr=recipe.lr, weight_decay=0.01, betas=(0.9, 0.98))

    def steps(self, batches, pad_id: int) -> list[float]:
        times = []
        masked = token_mask(self.model) if self.rung.token_mask else contextlib.nullcontext()
        with deterministic_algorithms(True), filling(self.rung.fill), masked:
            for rows in batches:
                started = time.perf_counter()
                pretraining_step(self.model, self.handle, self.opt, training_batch(rows, pad_id, self.recipe))
                times.append(time.perf_counter() - started)
        return times


def pretraining(args, tokenizer) -> dict[str, float]:
    recipe = replace(BaseRecipe(), **(SMOKE_BASE if args.smoke else {}))
    encoded = encode_tasks(tokenizer, training_pool(recipe.pool, recipe.seed, recipe.domain_params()))
    g = torch.Generator().manual_seed(recipe.seed)
    order = torch.randperm(len(encoded), generator=g).tolist()  # the pool's order, as pretrain draws it
    n = recipe.batch_size

    def batches(first: int, count: int):
        return [[encoded[order[(i * n + j) % len(order)]] for j in range(n)] for i in range(first, first + count)]

    runs = {r.name: Pretraining(recipe, r, len(tokenizer)) for r in PRETRAIN_LADDER}
    times: dict[str, list[float]] = {name: [] for name in runs}
    for run in runs.values():
        run.steps(batches(0, 2), tokenizer.pad_token_id)  # untimed
    for r in range(args.rounds):  # the rungs alternate: a slower stretch of the machine hits them all
        for name, run in runs.items():
            times[name] += run.steps(batches(2 + r * args.steps, args.steps), tokenizer.pad_token_id)
    return {name: statistics.median(t) for name, t in times.items()}


def post_cells(args, tokenizer) -> dict[str, float]:
    seconds = {}
    with tempfile.TemporaryDirectory() as tmp:
        base = Path(tmp) / "base"
        torch.manual_seed(0)
        recipe = BaseRecipe()
        model = AutoModelForCausalLM.from_config(tiny_config("moonlight", len(tokenizer), **recipe.model_overrides()))
        model.save_pretrained(base)
        tokenizer.save_pretrained(base)
        post = PostRecipe(max_steps=args.post_steps, **(SMOKE_POST if args.smoke else {}))
        data = write_rows(sample("math_post", post.train_rows, seed=post.data_seed), Path(tmp) / "math.jsonl")
        for i, rung in enumerate(CELL_LADDER):
            forget_labelled()
            if rung.labelled:  # as a cell before it in the same process would have
                load_labelled(data, load_tokenizer(str(base)), post.max_seq_len)
            cell = replace(post, kernels=rung.kernels)
            with filling(rung.fill):
                _, seconds[rung.name] = train_cell(base, data, None, Path(tmp) / str(i), "sft", 42, cell,
                                                   progress=False)  # fmt: skip
        # the lanes' processes start, import and label the data themselves: all of it is in the wall time
        jobs = [Job(train_cell, (base, data, None, Path(tmp) / f"lane{i}", "sft", 42 + i, post, None, False))
                for i in range(args.lanes)]  # fmt: skip
        started = time.perf_counter()
        run_jobs(jobs, args.lanes)
        seconds[LANES_RUNG.format(lanes=args.lanes)] = (time.perf_counter() - started) / args.lanes
    return seconds


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    torch.set_num_threads(args.threads)
    tokenizer = moonlight_tokenizer()
    step_s = pretraining(args, tokenizer)
    cell_s = post_cells(args, tokenizer)
    ref, fast = PRETRAIN_LADDER[0].name, PRETRAIN_LADDER[-1].name
    cref, cfast = CELL_LADDER[0].name, LANES_RUNG.format(lanes=args.lanes)
    for title, figures, unit in (("pretraining step", step_s, "s"), (f"post-training cell, {args.post_steps} steps",
                                                                    cell_s, "s")):  # fmt: skip
        print(title)
        first = next(iter(figures.values()))
        for name, value in figures.items():
            print(f"  {name:45s} {value:8.3f} {unit}  {first / value:5.2f}x")
    pre, cell = step_s[ref] / step_s[fast], cell_s[cref] / cell_s[cfast]
    print(json.dumps({"pretrain_step_s": step_s, "cell_s": cell_s, "pretrain_speedup": pre, "cell_speedup": cell,
                      "ratio": min(pre, cell), "post_steps": args.post_steps, "threads": args.threads,
                      "lanes": args.lanes, "machine": machine(),
                      **({"smoke": True} if args.smoke else {})}))  # fmt: skip


if __name__ == "__main__":
    main()
