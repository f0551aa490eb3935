"""What ``routing-kd``'s λ multiplies: the term's size per router transform and per source of the base's routing, on
the toy world's shipped bases (bases/base<seed>: Moonlight-shaped, 64 experts, top-6, sigmoid scores with a
correction bias) with the grids' recipe (batch 32, lr 3e-4, packed batches) at λ = 1.

Per base, the term (``anchor_loss`` in the log, λ = 1) at each of the first steps, for:

* ``online_softmax`` / ``online_sigmoid``: the base's own forward, the KL read under softmax (the grids') and under
  the normalised sigmoid (``rpb train``'s default on a DeepSeek-V3-class model). At step 1 the model is the base:
  the term is 0; its size over the next steps is what a λ is weighed against;
* ``routes_hinge`` / ``routes_set_ce`` / ``routes_topk_kl`` / ``routes_bucket``: stored routes (``rpb routes``),
  ids alone read by the selection rule's hinge (the default there: 0 at the base) or by the set cross-entropy
  (``anchor.routes_loss=set-ce``: not 0 at the base, the base's own top-k probabilities being below 1), and with
  the base's top-k probabilities (softmax) renormalised over the k (``topk-kl``: not 0 at the base either) or as
  they are with one bucket for the rest (the default with probabilities: 0 at the base).

Printed: each variant's term per step, and the ratios a reader converts a λ with (softmax over sigmoid after the
first step, the stored forms at the base). The last line is one JSON object.

``--smoke`` runs base 0 for 2 steps on batches of 4 rows: a check that the script runs.

Run: .venv/bin/python benchmarks/term_scale.py [--bases 0 1 2 --steps 6 --threads 2] [--smoke]
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
from pathlib import Path

import torch

from rpb.anchors import AnchorConfig
from rpb.toyworld.world.post import PostRecipe, write_rows
from rpb.toyworld.world.tasks import sample
from rpb.train.config import DataSection, RunConfig, TrainSection

BASES = Path(__file__).resolve().parents[1] / "bases"


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--bases", type=int, nargs="+", default=[0, 1, 2])
    p.add_argument("--steps", type=int, default=6)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--smoke", action="store_true", help="base 0, 2 steps, batches of 4")
    args = p.parse_args(argv)
    if args.smoke:
        p.set_defaults(bases=[0], steps=2)
        args = p.parse_args(argv)
    return args


def terms(base: Path, data: Path, out: Path, steps: int, batch: int, anchor: dict) -> list[float]:
    from rpb.train.run import run_training

    post = PostRecipe()
    cfg = RunConfig(
        model=str(base),
        data_jsonl=str(data),
        output_dir=str(out),
        anchor=AnchorConfig(method="routing-kd", lambda_=1.0, **anchor),
        train=TrainSection(
            max_steps=steps,
            seed=42,
            lr=post.lr,
            batch_size=batch,
            warmup_steps=0,
            log_every=1,
            max_seq_len=post.max_seq_len,
            save=False,
            calibrate_rows=0,
            experts_implementation=post.experts_implementation,
        ),
        data=DataSection(seed=42, packing=True),
    )
    cfg.monitor.enabled = False  # the term alone
    run_training(cfg, progress=False)
    logs = [json.loads(line) for line in (out / "log.jsonl").read_text().splitlines()]
    return [r["anchor_loss"] for r in logs if "anchor_loss" in r]


def main(argv: list[str] | None = None) -> None:
    from rpb.collect.hf_routes import write_routes

    a = parse_args(argv)
    torch.set_num_threads(a.threads)
    tmp = Path(tempfile.mkdtemp(prefix="term-scale-"))
    batch = 4 if a.smoke else PostRecipe().batch_size
    data = write_rows(sample("math_post", batch * a.steps, seed=0), tmp / "math_post.jsonl")
    out: dict[str, dict] = {}
    for seed in a.bases:
        base = BASES / f"base{seed}"
        ids, probs = tmp / f"ids{seed}.safetensors", tmp / f"probs{seed}.safetensors"
        write_routes(str(base), data, ids, PostRecipe().max_seq_len, batch_size=64)
        write_routes(str(base), data, probs, PostRecipe().max_seq_len, batch_size=64, probs_transform="softmax")
        variants = {
            "online_softmax": {"router_transform": "softmax"},
            "online_sigmoid": {"router_transform": "sigmoid-normalized"},
            "routes_hinge": {"router_transform": "softmax", "base": "routes", "routes": str(ids)},
            "routes_set_ce": {
                "router_transform": "softmax",
                "base": "routes",
                "routes": str(ids),
                "routes_loss": "set-ce",
            },
            "routes_topk_kl": {
                "router_transform": "softmax",
                "base": "routes",
                "routes": str(probs),
                "routes_loss": "topk-kl",
            },
            "routes_bucket": {"router_transform": "softmax", "base": "routes", "routes": str(probs)},
        }
        found = {k: terms(base, data, tmp / f"{k}-{seed}", a.steps, batch, v) for k, v in variants.items()}
        later = [s / g for s, g in zip(found["online_softmax"][1:], found["online_sigmoid"][1:], strict=True) if g > 0]
        out[str(seed)] = {
            "terms": {k: [round(t, 5) for t in v] for k, v in found.items()},
            "softmax_over_sigmoid": round(statistics.median(later), 3) if later else None,
            "at_base": {k: round(found[k][0], 5) for k in found},
        }
        print(f"base {seed}: " + ", ".join(f"{k} {v}" for k, v in out[str(seed)]["terms"].items()))
    print(json.dumps({"bases": out, "steps": a.steps, "threads": a.threads, **({"smoke": True} if a.smoke else {})}))


if __name__ == "__main__":
    main()
