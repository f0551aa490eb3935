"""What holding the routing costs per training step: routing-kd against plain fine-tuning, on the toy world's
shipped base 0 (bases/base0: a Moonlight-shaped MoE, 4 layers, 64 experts, top-6) and its math_post rows, with the
grids' recipe (batch 32, max_seq_len 96, packed batches, rpb's experts kernel).

Pairs, each a ratio of median step times (``rpb train``'s whole optimizer step: collation, the base's forward
where there is one, forward, backward, AdamW), measured in one process, rounds alternating the order:

* ``lora``: routing-kd online under LoRA (the model with its adapters off as the base, stopping at the last MoE
  router) / sft under LoRA (target <= 1.6);
* ``frozen_copy``: routing-kd online under full fine-tuning (a frozen copy as the base) / sft (target <= 1.45);
* ``stored``: routing-kd from stored top-k routes (``rpb routes``; no second model) / sft (target <= 1.05);
* ``grpo``: rpb's GRPO with beta = 0.04 and routing-kd (the reference forward's routing reused) / the same GRPO with
  beta alone (target <= 1.05); its steps include generation, as a GRPO step does (every completion 16 tokens,
  so generation costs the same in both). For context, routing-kd / ``kl-to-base`` at the same beta
  (``grpo_vs_kl_to_base``): a KL term of the same size read on the live forward, with no routing carried.

The exit status is 0 whether the targets hold or not; the last line printed is one JSON object.

``--smoke`` takes one step of every variant, on batches of 4 rows (GRPO: 2 prompts x 2 completions of 4 tokens),
and judges no target: a check that the script runs, not a measurement.

Run: .venv/bin/python benchmarks/teacher_overhead.py [--steps 8 --warmup 2 --rounds 2 --threads 2] [--smoke]
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time
from pathlib import Path

import torch
from transformers import TrainerCallback

from rpb.anchors import AnchorConfig
from rpb.toyworld.world.post import ROUTER_TRANSFORM, PostRecipe, write_rows
from rpb.toyworld.world.tasks import sample
from rpb.train.config import DataSection, RunConfig, TrainSection
from rpb.train.lora import LoraSection

BASE = Path(__file__).resolve().parents[1] / "bases" / "base0"
TARGETS = {"lora": 1.6, "frozen_copy": 1.45, "stored": 1.05, "grpo": 1.05}
#: the GRPO steps' shape: prompts x completions per step, and the completions' length (generation included)
GRPO_SHAPE = dict(per_device_train_batch_size=16, num_generations=4, max_completion_length=16)
#: --smoke: one step of every variant (an option given explicitly still wins), on small batches
SMOKE = dict(steps=1, warmup=0, rounds=1)
SMOKE_BATCH_SIZE = 4
SMOKE_GRPO_SHAPE = dict(per_device_train_batch_size=4, num_generations=2, max_completion_length=4)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--steps", type=int, default=8, help="timed steps per variant and round")
    p.add_argument("--warmup", type=int, default=2, help="steps left out at the start of each run")
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--pairs", default=",".join(TARGETS), help="comma-separated, of " + ", ".join(TARGETS))
    p.add_argument("--smoke", action="store_true", help="one step of each on small batches, no target judged")
    args = p.parse_args(argv)
    if args.smoke:  # again, on the smoke defaults: an option given explicitly still wins
        p.set_defaults(**SMOKE)
        args = p.parse_args(argv)
    return args


class StepTimes(TrainerCallback):
    def __init__(self):
        self.seconds: list[float] = []

    def on_step_begin(self, args, state, control, **kwargs):
        self._t = time.perf_counter()

    def on_step_end(self, args, state, control, **kwargs):
        self.seconds.append(time.perf_counter() - self._t)


def sft_config(out: Path, data: Path, steps: int, method: str, lora: bool, anchor: dict, batch_size: int) -> RunConfig:
    post = PostRecipe()
    train = TrainSection(max_steps=steps, seed=42, lr=post.lr, batch_size=batch_size, warmup_steps=0,
                         max_seq_len=post.max_seq_len, log_every=steps, save=False, calibrate_rows=0,
                         experts_implementation=post.experts_implementation)  # fmt: skip
    return RunConfig(
        model=str(BASE),
        data_jsonl=str(data),
        output_dir=str(out),
        anchor=AnchorConfig(method=method, router_transform=ROUTER_TRANSFORM, **anchor),
        train=train,
        data=DataSection(seed=42, packing=True),
        lora=LoraSection(rank=8, alpha=16) if lora else LoraSection(),
    )


def sft_step_times(cfg: RunConfig, warmup: int) -> list[float]:
    from rpb.train.run import run_training

    timer = StepTimes()
    run_training(cfg, progress=False, callbacks=[timer])
    return timer.seconds[warmup:]


def grpo_step_times(out: Path, steps: int, warmup: int, method: str, shape: dict) -> list[float]:
    import datasets

    from rpb.anchors import install_anchor
    from rpb.integrations.trl import GRPOConfig, GRPOTrainer
    from rpb.models import load_causal_lm, load_tokenizer

    tok = load_tokenizer(str(BASE))
    tok.padding_side = "left"
    model = load_causal_lm(str(BASE)).train()
    # only the coefficient the method reads (sft reads none): AnchorConfig refuses a leftover one
    config = AnchorConfig.for_method(method, lambda_=0.1, router_transform=ROUTER_TRANSFORM)
    anchor = install_anchor(model, config)
    prompts = [{"prompt": t.question} for t in sample("math_post", 64, seed=3)]
    args = GRPOConfig(output_dir=str(out), max_steps=steps, **shape, learning_rate=1e-5, logging_steps=steps,
                      save_strategy="no", report_to=[], use_cpu=True, seed=7, disable_tqdm=True, beta=0.04,
                      bf16=False, generation_kwargs={"min_new_tokens": shape["max_completion_length"]})  # fmt: skip

    def reward(completions, **kwargs):
        return [float(len(c) % 3) for c in completions]

    timer = StepTimes()
    trainer = GRPOTrainer(model, reward, args, datasets.Dataset.from_list(prompts), processing_class=tok,
                          anchor=anchor, callbacks=[timer])  # fmt: skip
    trainer.train()
    anchor.remove()
    trainer.replay.remove()
    return timer.seconds[warmup:]


def main(argv: list[str] | None = None) -> None:
    a = parse_args(argv)
    torch.set_num_threads(a.threads)
    tmp = Path(tempfile.mkdtemp(prefix="teacher-overhead-"))
    batch = SMOKE_BATCH_SIZE if a.smoke else PostRecipe().batch_size
    grpo = SMOKE_GRPO_SHAPE if a.smoke else GRPO_SHAPE
    data = write_rows(sample("math_post", batch * (a.steps + a.warmup), seed=0), tmp / "math_post.jsonl")
    routes = tmp / "routes.safetensors"
    from rpb.collect.hf_routes import write_routes

    write_routes(str(BASE), data, routes, PostRecipe().max_seq_len, batch_size=64)
    n = a.steps + a.warmup
    kd = {"lambda_": 0.1}
    stored = kd | {"base": "routes", "routes": str(routes)}
    variants = {
        "lora_sft": lambda out: sft_step_times(sft_config(out, data, n, "sft", True, {}, batch), a.warmup),
        "lora_kd": lambda out: sft_step_times(sft_config(out, data, n, "routing-kd", True, kd, batch), a.warmup),
        "full_sft": lambda out: sft_step_times(sft_config(out, data, n, "sft", False, {}, batch), a.warmup),
        "full_kd": lambda out: sft_step_times(sft_config(out, data, n, "routing-kd", False, kd, batch), a.warmup),
        "stored_kd": lambda out: sft_step_times(sft_config(out, data, n, "routing-kd", False, stored, batch), a.warmup),
        "grpo_beta": lambda out: grpo_step_times(out, n, a.warmup, "sft", grpo),
        "grpo_kd": lambda out: grpo_step_times(out, n, a.warmup, "routing-kd", grpo),
        "grpo_kl": lambda out: grpo_step_times(out, n, a.warmup, "kl-to-base", grpo),
    }
    pairs = {"lora": ("lora_kd", "lora_sft"), "frozen_copy": ("full_kd", "full_sft"),
             "stored": ("stored_kd", "full_sft"), "grpo": ("grpo_kd", "grpo_beta"),
             "grpo_vs_kl_to_base": ("grpo_kd", "grpo_kl")}  # fmt: skip
    wanted = [p for p in a.pairs.split(",") if p]
    if "grpo" in wanted:  # context: a term of the same kind read on the live forward, no base routing carried
        wanted.append("grpo_vs_kl_to_base")
    order = [v for v in variants if any(v in pairs[p] for p in wanted)]
    times: dict[str, list[float]] = {k: [] for k in order}
    for r in range(a.rounds):
        for name in order if r % 2 == 0 else order[::-1]:
            times[name] += variants[name](tmp / f"{name}-{r}")
    med = {k: statistics.median(v) for k, v in times.items()}
    ratios = {p: med[pairs[p][0]] / med[pairs[p][1]] for p in wanted}
    judged = {} if a.smoke else TARGETS
    for name, value in ratios.items():
        note = f"target <= {TARGETS[name]}" if name in judged else "context"
        note = "--smoke: no target judged" if a.smoke and name in TARGETS else note
        print(f"{name}: {value:.3f} ({note})")
    print(json.dumps({"median_step_seconds": {k: round(v, 4) for k, v in med.items()},
                      "ratios": {k: round(v, 3) for k, v in ratios.items()},
                      "targets_met": {k: ratios[k] <= TARGETS[k] for k in ratios if k in judged}, "threads": a.threads,
                      "steps_per_variant": a.steps * a.rounds, **({"smoke": True} if a.smoke else {})}))  # fmt: skip


if __name__ == "__main__":
    main()
