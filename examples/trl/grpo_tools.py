"""GRPO with TRL's tool loop on an MoE model, its routes replayed with R3 through the tool's turns (docs/rl.md,
"Tool calling").

    python examples/trl/grpo_tools.py --output-dir runs/tools        # a tiny Qwen3-MoE replica, on the CPU
    accelerate launch examples/trl/grpo_tools.py --model Qwen/Qwen3-30B-A3B --output-dir runs/tools-qwen3 \\
        --max-steps 200

TRL's tool loop parses the model's tool calls with a response schema it knows by chat template, and trains a
multi-turn completion only on a template that renders earlier turns unchanged and marks the assistant's tokens
(``{% generation %}``). A checkpoint's own template may be neither (the Qwen3-MoE replica's is the vendor's), so
this recipe gives the tokenizer TRL's Qwen3 template (``trl.chat_template_utils.qwen3_chat_template``): TRL knows
its response schema, and swaps in its training variant, with the markers, for the multi-turn forwards. A tool's
result is no choice of the model: under R3 its tokens carry the routes the engine recorded when it read them, and
they count in no mismatch figure.

The reward is written here: 1 when the model called ``add`` and its final turn states the sum the tool returned,
0.5 when it called the tool only. A tiny random model almost never calls a tool; the test of this recipe makes some
rollouts call it (tests/integrations/trl/test_grpo_tools.py).
"""

from __future__ import annotations

import argparse
import re
import sys
from pathlib import Path

PROMPTS = ["What is 1 + 2? Use the tool.", "Add 3 and 4.", "What is 10 + 5?", "Sum 2 and 2."]


def add(a: int, b: int) -> int:
    """Add two integers.

    Args:
        a: the first.
        b: the second.
    """
    return a + b


def tool_reward(completions, **kwargs) -> list[float]:
    """1 when a completion called the tool and its last message states the tool's result; 0.5 for the call alone."""
    out = []
    for messages in completions:
        results = [m["content"] for m in messages if m.get("role") == "tool"]
        if not results:
            out.append(0.0)
            continue
        said = (messages[-1].get("content") or "") if messages[-1].get("role") == "assistant" else ""
        out.append(1.0 if re.search(rf"\b{re.escape(str(results[-1]).strip())}\b", said) else 0.5)
    return out


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", help="hub id or local directory (default: a tiny Qwen3-MoE replica, built here)")
    p.add_argument("--output-dir", required=True)
    p.add_argument("--replay", default="R3", choices=["off", "R2", "R3"], help="routing replay (default R3)")
    p.add_argument("--max-steps", type=int, default=2)
    p.add_argument("--max-completion-length", type=int, default=None, help="default 160 on the replica, else 1024")
    p.add_argument("--seed", type=int, default=0)
    return p.parse_args(argv)


def build(args: argparse.Namespace):
    """``(trainer, anchor)``: the model, its tokenizer with TRL's Qwen3 template, and rpb's GRPOTrainer with the
    tool; the test drives it from here."""
    import datasets
    from transformers import AutoModelForCausalLM
    from trl.chat_template_utils import qwen3_chat_template

    from rpb.anchors import AnchorConfig, install_anchor
    from rpb.integrations.trl import GRPOConfig, GRPOTrainer
    from rpb.models import load_tokenizer

    where = args.model
    if where is None:
        from rpb.testing import replica

        where = str(replica("qwen3_30b_a3b", Path(args.output_dir) / "replica", seed=args.seed))
    tokenizer = load_tokenizer(where)
    tokenizer.padding_side = "left"
    tokenizer.chat_template = qwen3_chat_template  # a template TRL knows: its response schema and training variant
    model = AutoModelForCausalLM.from_pretrained(where, dtype="auto").train()
    anchor = install_anchor(model, AnchorConfig(method="sft"))
    config = GRPOConfig(
        output_dir=args.output_dir,
        max_steps=args.max_steps,
        per_device_train_batch_size=4,
        num_generations=4,
        max_completion_length=args.max_completion_length or (160 if args.model is None else 1024),
        learning_rate=1e-3 if args.model is None else 1e-6,
        logging_steps=1,
        save_strategy="no",
        report_to=[],
        seed=args.seed,
        bf16=False,
        beta=0.0,
        replay=args.replay,
        rollout_dtype="bfloat16",
        use_cpu=args.model is None,
        disable_tqdm=True,
    )
    data = datasets.Dataset.from_list([{"prompt": [{"role": "user", "content": p}]} for p in PROMPTS])
    trainer = GRPOTrainer(model, tool_reward, config, data, processing_class=tokenizer, anchor=anchor, tools=[add])
    return trainer, anchor


def main(argv: list[str] | None = None) -> int:
    trainer, anchor = build(parse_args(argv))
    trainer.train()
    shown = ("reward", "tools/", "routing/rollout", "routing/stale_mismatch")
    for entry in trainer.state.log_history:
        figures = {k: round(v, 4) for k, v in entry.items() if k.startswith(shown)}
        if figures:
            print(f"step {entry['step']}: {figures}")
    trainer.replay.remove()
    anchor.remove()
    return 0


if __name__ == "__main__":
    sys.exit(main())
