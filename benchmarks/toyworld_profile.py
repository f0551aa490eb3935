"""Where a toy-world pretraining step spends its time, and what one lever on the MoE experts does to it.

The toy world's base (``BaseRecipe``: Moonlight-shaped, 4 layers, 64 experts of width 64, top-6, batches of 64
pretraining conversations) takes pretraining steps exactly as ``rpb.toyworld.world.base.pretrain`` does (lbl anchor
on, deterministic kernels on, AdamW, clipping), on the first batches of the real pretraining pool, under each of
transformers' expert implementations that run on the CPU (``grouped_mm``, its default, and ``eager``) and a
padded batched-matmul one registered here (``padded_bmm``); for the default, the operators with the most self
time (torch.profiler); every implementation's first loss on the same weights and batch. Then one layer's expert
MLP, forward and backward, on the same shapes with a random router's top-6: transformers' per-expert loop against
one padded batched matmul per projection, with their largest difference.

Nothing here changes the toy world; it measures. Ratios are within this run. The last line printed is one
JSON object: ``step_s`` per implementation (median), ``step_speedup`` (grouped_mm / padded_bmm), ``first_loss``,
``encode_s`` (tokenising the pool once),
``experts_speedup`` (loop / padded, median fwd+bwd), ``max_abs_diff``.

``--smoke`` takes one timed step per implementation, and profiles one, on batches of 8 conversations from a pool
of 128: a check that the script runs, not a measurement.

Run: .venv/bin/python benchmarks/toyworld_profile.py [--steps 8 --threads 2] [--smoke]
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from dataclasses import replace

import torch
from transformers import AutoModelForCausalLM

from rpb.anchors import AnchorConfig, install_anchor
from rpb.prior import STRUCTURAL
from rpb.testing.models import tiny_config
from rpb.testing.tokenizers import moonlight_tokenizer
from rpb.toyworld.world.base import BaseRecipe, _batch, encode_tasks, training_pool
from rpb.train.run import deterministic_algorithms

#: steps under the profiler, after the timed ones
PROFILED = 4
#: --smoke: one timed step (an option given explicitly still wins), one profiled, small batches from a small pool
SMOKE = dict(steps=1)
SMOKE_PROFILED = 1
SMOKE_RECIPE = dict(pool=128, batch_size=8)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--steps", type=int, default=8, help="timed steps per implementation (after 2 untimed)")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--smoke", action="store_true", help="one step per implementation on small batches")
    args = p.parse_args(argv)
    if args.smoke:  # again, on the smoke defaults: an option given explicitly still wins
        p.set_defaults(**SMOKE)
        args = p.parse_args(argv)
    return args


def padded_bmm_experts_forward(self, hidden_states, top_k_index, top_k_weights):
    """transformers' experts interface (``experts_implementation="padded_bmm"``): the fused weights of
    DeepseekV3Experts (gate_up_proj [E, 2I, H], down_proj [E, H, I]) applied as one bmm per projection to the
    assignments sorted by expert and padded to the busiest expert's count."""
    E, k = self.gate_up_proj.shape[0], top_k_index.shape[-1]
    flat = top_k_index.reshape(-1)
    order = torch.argsort(flat, stable=True)
    counts_E = torch.bincount(flat, minlength=E)
    expert, token = flat[order], order // k
    slot = torch.arange(flat.numel(), device=flat.device) - (torch.cumsum(counts_E, 0) - counts_E)[expert]
    x_ECH = hidden_states.new_zeros(E, int(counts_E.max()), hidden_states.shape[-1])
    x_ECH = x_ECH.index_put((expert, slot), hidden_states[token])
    gate, up = torch.bmm(x_ECH, self.gate_up_proj.transpose(1, 2)).chunk(2, -1)
    y_ECH = torch.bmm(self.act_fn(gate) * up, self.down_proj.transpose(1, 2))
    y_SH = y_ECH[expert, slot] * top_k_weights.reshape(-1)[order][:, None].to(y_ECH.dtype)
    return torch.zeros_like(hidden_states).index_add(0, token, y_SH.to(hidden_states.dtype))


def pretraining_steps(recipe: BaseRecipe, encoded, tokenizer, impl: str, steps: int, profile: int):
    torch.manual_seed(recipe.seed)
    config = tiny_config("moonlight", len(tokenizer), **recipe.model_overrides())
    model = AutoModelForCausalLM.from_config(config, experts_implementation=impl)
    model.train()
    handle = install_anchor(model, AnchorConfig(method="lbl", lbl_coef=recipe.lbl_coef))
    opt = torch.optim.AdamW(model.parameters(), lr=recipe.lr, weight_decay=0.01, betas=(0.9, 0.98))

    def step(i: int) -> None:
        batch = _batch(encoded[i * recipe.batch_size : (i + 1) * recipe.batch_size], tokenizer.pad_token_id)
        sample_BT = torch.zeros_like(batch["input_ids"])
        with handle.step(sample_BT, torch.full_like(sample_BT, STRUCTURAL), batch["attention_mask"]):
            loss = model(**batch).loss
            (loss + handle.loss()).backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)
        return float(loss.detach())

    times, table = [], None
    with deterministic_algorithms(True):
        first_loss = step(0)  # the same weights and batch under every implementation: the losses must agree
        step(1)
        for i in range(2, 2 + steps):
            started = time.perf_counter()
            step(i)
            times.append(time.perf_counter() - started)
        if profile:
            from torch.profiler import ProfilerActivity
            from torch.profiler import profile as torch_profile

            with torch_profile(activities=[ProfilerActivity.CPU]) as prof:
                for i in range(2 + steps, 2 + steps + profile):
                    step(i)
            table = prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=12)
    handle.remove()
    return statistics.median(times), table, first_loss


def expert_mlps(recipe: BaseRecipe, vocab: int, tokens: int, rounds: int = 7) -> dict:
    """One MoE layer's expert MLPs, forward + backward: transformers' own experts module run as its per-expert
    loop (``eager``) vs ``padded_bmm_experts_forward`` on the same module, weights and routing."""
    from transformers.models.deepseek_v3.modeling_deepseek_v3 import DeepseekV3Experts

    torch.manual_seed(0)
    config = tiny_config("moonlight", vocab, **recipe.model_overrides())
    config._experts_implementation = "eager"
    experts = DeepseekV3Experts(config)
    for weight in (experts.gate_up_proj, experts.down_proj):
        torch.nn.init.normal_(weight, std=0.05)
    x_TH = torch.randn(tokens, recipe.hidden_size, requires_grad=True)
    router_HE = torch.randn(recipe.hidden_size, recipe.n_routed_experts)
    w_TK, idx_TK = torch.sigmoid(x_TH.detach() @ router_HE).topk(recipe.num_experts_per_tok, dim=-1)
    gate_up_EXH, down_EHI = experts.gate_up_proj, experts.down_proj
    variants = {"loop": lambda x: experts(x, idx_TK, w_TK),
                "padded_bmm": lambda x: padded_bmm_experts_forward(experts, x, idx_TK, w_TK)}  # fmt: skip

    seconds, grads = {}, {}
    with deterministic_algorithms(True):
        for name, fn in variants.items():
            times = []
            for _ in range(rounds):
                for p in (gate_up_EXH, down_EHI, x_TH):
                    p.grad = None
                started = time.perf_counter()
                out = fn(x_TH)
                out.square().sum().backward()
                times.append(time.perf_counter() - started)
            seconds[name] = statistics.median(times[1:])
            grads[name] = (out.detach(), gate_up_EXH.grad.clone(), down_EHI.grad.clone(), x_TH.grad.clone())
    diff = max(float((a - b).abs().max()) for a, b in zip(grads["loop"], grads["padded_bmm"], strict=True))
    return {"seconds": seconds, "speedup": seconds["loop"] / seconds["padded_bmm"], "max_abs_diff": diff}


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    torch.set_num_threads(args.threads)
    recipe, tokenizer = replace(BaseRecipe(), **(SMOKE_RECIPE if args.smoke else {})), moonlight_tokenizer()
    started = time.perf_counter()
    encoded = encode_tasks(tokenizer, training_pool(recipe.pool, recipe.seed, recipe.domain_params()))
    encode_s = time.perf_counter() - started
    steps, losses = {}, {}
    from transformers.integrations.moe import ALL_EXPERTS_FUNCTIONS

    ALL_EXPERTS_FUNCTIONS.register("padded_bmm", padded_bmm_experts_forward)
    profiled = SMOKE_PROFILED if args.smoke else PROFILED
    for impl in ("grouped_mm", "eager", "padded_bmm"):
        steps[impl], table, losses[impl] = pretraining_steps(
            recipe, encoded, tokenizer, impl, args.steps, profiled if impl == "grouped_mm" else 0
        )
        if table:
            print(f"top operators by self CPU time, {impl} ({profiled} steps):\n{table}")
    width = _batch(encoded[: recipe.batch_size], 0)["input_ids"].shape[1]
    experts = expert_mlps(recipe, len(tokenizer), recipe.batch_size * width)
    print(json.dumps({"step_s": steps, "step_speedup": steps["grouped_mm"] / steps["padded_bmm"],
                      "first_loss": losses, "encode_s": encode_s, "experts_seconds": experts["seconds"],
                      "experts_speedup": experts["speedup"], "max_abs_diff": experts["max_abs_diff"],
                      "threads": args.threads, "batch_tokens": recipe.batch_size * width,
                      **({"smoke": True} if args.smoke else {})}))  # fmt: skip


if __name__ == "__main__":
    main()
