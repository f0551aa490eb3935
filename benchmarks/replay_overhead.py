"""What routing replay costs: a GRPO-shaped training step with ``R3`` against ``off`` and ``PR2`` against ``R3``, and
generation with the
routes recorded against generation without, on the toy world's shipped base 0 (bases/base0: a Moonlight-shaped
MoE, 4 layers, 64 experts, top-6, DeepSeek-V3 routing).

One fixed batch of rollouts is generated first (the toy world's prompts, sampled completions, recorded), then
timed, in one process, alternating the order every round:

* the training step (generation excluded): a forward of prompt and completion, the completion tokens'
  log-probabilities, a policy-gradient loss with fixed advantages, backward, AdamW; ``plain`` (no hook),
  ``off`` (rpb's GRPO ``off``: the routers' own choice recorded for the mismatch figures), ``R3`` (the
  rollout's routes replayed) and ``PR2`` (the routes a predictor's forward chose, replayed, the routers' logits
  kept at the completion positions, and the predictor's loss back-propagated and stepped: a later update's
  step, its costliest), each on its own copy of the model and optimizer;
* generation: ``model.generate`` of the same prompts, the same seed, with and without ``GenerationRecorder``.

Per variant the median of ``--steps`` timed repeats after ``--warmup``. ``ratio`` = R3 / off (target <= 1.10),
``pr2_ratio`` = PR2 / R3 (target <= 1.15),
``ratio_vs_plain`` = R3 / plain, ``generation_ratio`` = recorded / plain generation (the recorded variant's time
includes reading its routes and log-probabilities off the device: the one transfer a generation makes). The
exit status is 0 whether the target holds or not; the last line printed is one JSON object.

``--device cuda`` runs the same on a GPU, where a host copy is not free (report only: the target is the CPU's;
the clocks are read after ``torch.cuda.synchronize()``).

``--smoke`` times one repeat of each on 2 rollouts of 2 new tokens and judges no target: a check that the
script runs, not a measurement.

Run: .venv/bin/python benchmarks/replay_overhead.py [--steps 7 --warmup 2 --rollouts 16 --new-tokens 24]
     [--device cuda] [--smoke]
"""

from __future__ import annotations

import argparse
import contextlib
import copy
import functools
import json
import statistics
import time
from pathlib import Path

import torch

from rpb.adapters import find_moe_layers, get_adapter
from rpb.models import load_causal_lm, load_tokenizer
from rpb.prior import family_transform
from rpb.replay import GenerationRecorder, RoutePredictor, RouteReplay, batch_routes, predictor_loss, rollout_routes
from rpb.toyworld.world.tasks import sample

BASE = Path(__file__).resolve().parents[1] / "bases" / "base0"
TARGET = 1.10
PR2_TARGET = 1.15
#: --smoke: one timed repeat on two short rollouts (an option given explicitly still wins)
SMOKE = dict(steps=1, warmup=0, rollouts=2, new_tokens=2)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--steps", type=int, default=7, help="timed repeats per variant (median reported)")
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--rollouts", type=int, default=16)
    p.add_argument("--new-tokens", type=int, default=24)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--device", default="cpu", help="cpu, or cuda (report only)")
    p.add_argument("--smoke", action="store_true", help="one repeat on 2 short rollouts, no target judged")
    args = p.parse_args(argv)
    if args.smoke:  # again, on the smoke defaults: an option given explicitly still wins
        p.set_defaults(**SMOKE)
        args = p.parse_args(argv)
    return args


def prompts(tokenizer, n: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``n`` toy-world questions, left-padded: ``(prompt_ids, prompt_mask)``."""
    tasks = sample("math", n, seed=0)
    ids = [tokenizer(t.question)["input_ids"] for t in tasks]
    P = max(len(i) for i in ids)
    prompt_ids = torch.zeros((n, P), dtype=torch.long)
    prompt_mask = torch.zeros((n, P), dtype=torch.long)
    for b, row in enumerate(ids):
        prompt_ids[b, P - len(row) :] = torch.tensor(row)
        prompt_mask[b, P - len(row) :] = 1
    return prompt_ids, prompt_mask


def generate(model, prompt_ids, prompt_mask, new_tokens: int, recorder: GenerationRecorder | None):
    torch.manual_seed(0)
    kwargs = dict(max_new_tokens=new_tokens, min_new_tokens=new_tokens, do_sample=True, top_k=0, pad_token_id=0)
    with torch.no_grad():
        if recorder is None:
            return model.generate(input_ids=prompt_ids, attention_mask=prompt_mask, **kwargs)
        with recorder:
            seqs = model.generate(input_ids=prompt_ids, attention_mask=prompt_mask, **kwargs)
        recorder.routes_BSLK, recorder.logps(seqs, prompt_len=prompt_ids.shape[1])  # the one transfer, timed
        return seqs


def training_step(model, optimizer, seqs, mask, advantages, C: int, replay=None, routes=None, pr2=None) -> None:
    """Forward, the completion tokens' log-probabilities, a policy-gradient loss, backward, (PR2) the predictor's
    loss and its backward, AdamW."""
    keep = C if pr2 is not None else 0
    with replay.forward(routes, keep_last=keep) if replay is not None else contextlib.nullcontext():
        logits = model(input_ids=seqs, attention_mask=mask).logits[:, -C - 1 : -1].float()
        logps = torch.log_softmax(logits, -1).gather(-1, seqs[:, -C:, None]).squeeze(-1)
        loss = -(advantages[:, None] * logps).mean()
        loss.backward()
        if pr2 is not None:
            predictor, inputs_BCLH, recorded_BCLE, transform = pr2
            count_BC = torch.ones(recorded_BCLE.shape[:2], dtype=torch.bool, device=recorded_BCLE.device)
            predictor_loss(predictor, inputs_BCLH, recorded_BCLE, replay.kept_BCLE, count_BC, transform).backward()
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)


def timed(fn, device: torch.device) -> float:
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    sync()
    start = time.perf_counter()
    fn()
    sync()
    return time.perf_counter() - start


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    torch.set_num_threads(args.threads)
    device = torch.device(args.device)
    tokenizer = load_tokenizer(str(BASE))
    base = load_causal_lm(str(BASE), "float32").to(device).train()
    facts = get_adapter(base.config.model_type)
    prompt_ids, prompt_mask = (t.to(device) for t in prompts(tokenizer, args.rollouts))
    recorder = GenerationRecorder(base, find_moe_layers(base, facts), temperature=1.0)
    seqs = generate(base, prompt_ids, prompt_mask, args.new_tokens, recorder)
    C = args.new_tokens
    mask = torch.cat([prompt_mask, torch.ones_like(seqs[:, -C:])], dim=1)
    routes = batch_routes(rollout_routes(recorder.routes_BSLK, mask.cpu()), prompt_mask, torch.ones_like(seqs[:, -C:]))
    advantages = torch.linspace(-1, 1, args.rollouts, device=device)

    variants = {}
    for name in ("plain", "off", "R3", "PR2"):
        model = copy.deepcopy(base)
        replay = RouteReplay(model) if name != "plain" else None
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-6)
        variants[name] = (model, optimizer, replay, routes if name == "R3" else None, None)
    model, optimizer, replay, _, _ = variants["PR2"]
    layers = replay.layers
    predictor = RoutePredictor([m.router.weight.shape[1] for m in layers], [s.num_experts for s in replay.specs])
    predictor = predictor.to(device)
    with torch.no_grad():  # a predictor that moves the routes, as after a few updates
        for linear in predictor.linears:
            linear.weight.normal_(0.0, 1.0 / linear.weight.shape[1] ** 0.5)
    optimizer.add_param_group({"params": list(predictor.parameters()), "lr": 1e-3})
    with torch.no_grad(), replay.forward(predictor=predictor, keep_last=C):  # the batch's first forward
        model(input_ids=seqs, attention_mask=mask)
    pr2 = (predictor, replay.kept_inputs_BCLH, replay.kept_BCLE, family_transform(facts.score_function))
    variants["PR2"] = (model, optimizer, replay, replay.chosen_BSLK, pr2)
    times = {name: [] for name in variants}
    gen_times = {"plain": [], "recorded": []}
    for round_ in range(args.warmup + args.steps):
        order = list(variants) if round_ % 2 == 0 else list(reversed(list(variants)))
        for name in order:
            model, optimizer, replay, given, pr2 = variants[name]
            step = functools.partial(training_step, model, optimizer, seqs, mask, advantages, C, replay, given, pr2)
            t = timed(step, device)
            if round_ >= args.warmup:
                times[name].append(t)
        for name in ("plain", "recorded") if round_ % 2 == 0 else ("recorded", "plain"):
            rec = recorder if name == "recorded" else None
            t = timed(lambda r=rec: generate(base, prompt_ids, prompt_mask, args.new_tokens, r), device)
            if round_ >= args.warmup:
                gen_times[name].append(t)
    median = {name: statistics.median(v) for name, v in times.items()}
    gen_median = {name: statistics.median(v) for name, v in gen_times.items()}
    for name, value in median.items():
        print(f"training step {name:>5}: {value * 1000:8.1f} ms (median of {args.steps})")
    for name, value in gen_median.items():
        print(f"generation {name:>8}: {value * 1000:8.1f} ms (median of {args.steps})")
    judged = device.type == "cpu" and not args.smoke  # the targets are the CPU's; --smoke measures nothing
    result = {
        "ratio": round(median["R3"] / median["off"], 4),
        "pr2_ratio": round(median["PR2"] / median["R3"], 4),
        "pr2_target": PR2_TARGET if judged else None,
        "pr2_holds": median["PR2"] / median["R3"] <= PR2_TARGET if judged else None,
        "ratio_vs_plain": round(median["R3"] / median["plain"], 4),
        "off_vs_plain": round(median["off"] / median["plain"], 4),
        "generation_ratio": round(gen_median["recorded"] / gen_median["plain"], 4),
        "target": TARGET if judged else None,
        "holds": median["R3"] / median["off"] <= TARGET if judged else None,
        "device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
        "rollouts": args.rollouts,
        "tokens": int(seqs.shape[1]),
        "threads": args.threads,
        "steps": args.steps,
    }
    result |= {"smoke": True} if args.smoke else {}  # a smoke run's figures are no measurement
    print(json.dumps(result))


if __name__ == "__main__":
    main()
