"""One GRPO run of rpb's trainer, as one process or as one rank of a torchrun: R3, ``kl-to-base`` and the routing
monitor on a tiny DeepSeek-V3 (Moonlight) model, learning rate 0, greedy float32 generation, the same 8 rollouts
a step in all (4 prompts x 2 generations), split over the ranks.

``python grpo_worker.py OUT`` (or under torchrun) runs it twice in one launch (the launches are the cost), with R3
and with PR2 (its predictor started from seeded weights, its learning rate 0 as the model's). Each rank writes
``OUT/<mode>/rank<r>.json``: the positions whose replayed experts it checked against its own micro-batches' routes
(a hook of its own on each experts module) and how many differed, and under PR2 the predictor's gradients as the
optimizer step sees them (after the ranks' sum); rank 0 adds the log history."""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import datasets
import torch
from transformers import TrainerCallback

from rpb.anchors import AnchorConfig, install_anchor
from rpb.integrations.trl import GRPOConfig, GRPOTrainer
from rpb.monitor import attach_monitor
from rpb.testing.models import build_tiny_model
from rpb.testing.tokenizers import moonlight_tokenizer

PROMPTS = ["abc def", "hello wor", "one two three", "xyz q"]
ROLLOUTS = 8  # a step's rollouts over every rank


def reward(completions, **kwargs):
    return [float(c.count("a") + c.count("e")) for c in completions]


def main(out: Path) -> None:
    for mode in ("R3", "PR2"):
        (out / mode).mkdir(exist_ok=True)
        one_run(out / mode, pr2=mode == "PR2")
    if torch.distributed.is_initialized():
        # gloo's threads outliving the interpreter abort the process at exit ("terminate called without an
        # active exception") once in a while: every rank's file is written, so meet and leave at once
        torch.distributed.barrier()
        torch.distributed.destroy_process_group()
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(0)


def one_run(out: Path, pr2: bool) -> None:
    torch.manual_seed(0)
    world = int(os.environ.get("WORLD_SIZE", "1"))
    rank = int(os.environ.get("RANK", "0"))
    tok = moonlight_tokenizer()
    tok.padding_side = "left"
    model = build_tiny_model("moonlight", len(tok), seed=0).train()
    anchor = install_anchor(model, AnchorConfig(method="kl-to-base", lambda_=0.1))
    gloo = {"ddp_backend": "gloo"} if world > 1 else {}
    args = GRPOConfig(**gloo, output_dir=str(out / "run"), max_steps=2, per_device_train_batch_size=ROLLOUTS // world,
                      num_generations=2, max_completion_length=6, learning_rate=0.0, logging_steps=1,
                      save_strategy="no", report_to=[], use_cpu=True, seed=7, disable_tqdm=True, beta=0.0,
                      bf16=False, replay="PR2" if pr2 else "R3", generation_kwargs={"do_sample": False},
                      steps_per_generation=1, num_iterations=2, pr2_lr_scale=1.0)  # fmt: skip
    data = datasets.Dataset.from_list([{"prompt": p} for p in PROMPTS * 4])
    trainer = GRPOTrainer(model, reward, args, data, processing_class=tok, anchor=anchor)
    attach_monitor(trainer)
    grads = []
    if pr2:  # a predictor away from zero: its loss has a gradient although the policy (lr 0) never moves
        gen = torch.Generator().manual_seed(3)
        with torch.no_grad():
            for linear in trainer.pr2.linears:
                linear.weight.copy_(torch.randn(linear.weight.shape, generator=gen) / linear.weight.shape[1] ** 0.5)

        def capture(*_):  # registered after rpb's own pre-hook: the gradients the step takes
            grads.append([p.grad.tolist() if p.grad is not None else None for p in trainer.pr2.parameters()])

        class Capture(TrainerCallback):
            def on_train_begin(self, args, state, control, **kwargs):
                trainer.optimizer.optimizer.register_step_pre_hook(capture)

        trainer.add_callback(Capture())
    seen, experts = [], {}
    prepare = trainer._prepare_inputs
    trainer._prepare_inputs = lambda batch: seen.append((prepare(batch), dict(experts))) or seen[-1][0]

    def hook_for(pos):
        def hook(module, args_):
            if module.training and torch.is_grad_enabled():
                experts[pos] = args_[1].detach().clone()

        return hook

    for pos, m in enumerate(trainer.replay.layers):
        experts_module = trainer.model.get_submodule(m.name.rpartition(".")[0] + ".experts")
        experts_module.register_forward_pre_hook(hook_for(pos))
    trainer.train()
    checked = differed = 0
    for step, (inputs, _) in enumerate(seen):
        got = seen[step + 1][1] if step + 1 < len(seen) else dict(experts)  # this micro-batch's forward
        routes = inputs["rpb_pr2_routes" if pr2 else "rpb_rollout_routes"]
        has = (routes >= 0).all(-1).all(-1)
        B, S = has.shape
        for pos in range(routes.shape[2]):
            received = got[pos].reshape(B, S, -1)[has].sort(-1).values
            differed += int((received != routes[has][:, pos].sort(-1).values.to(received.dtype)).any(-1).sum())
            checked += int(has.sum())
    result = {"rank": rank, "world": world, "checked": checked, "differed": differed, "grads": grads}
    if rank == 0:
        result["log_history"] = trainer.state.log_history
    (out / f"rank{rank}.json").write_text(json.dumps(result))
    trainer.replay.remove()
    anchor.remove()


if __name__ == "__main__":
    main(Path(sys.argv[1]))
