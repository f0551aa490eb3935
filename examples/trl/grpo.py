"""GRPO with TRL on an MoE model, the routing held: a loss anchor, routing replay, and the rollout-vs-training
mismatch logged every step (docs/rl.md).

    python examples/trl/grpo.py --output-dir runs/grpo-tiny            # a tiny local Qwen3-MoE, on the CPU
    accelerate launch examples/trl/grpo.py --model Qwen/Qwen3-30B-A3B --output-dir runs/grpo-qwen3 \\
        --method kl-to-base --lambda 0.1 --replay R3 --max-steps 200

The reward is written here: it counts the vowels of a completion, so that a tiny random model has something to
learn on the CPU; replace ``vowel_reward`` (and the prompts) with a real task's. TRL's native load-balancing
loss stays off in every mode; ``--method lbl`` is rpb's own term.
"""

from __future__ import annotations

import argparse
import sys

PROMPTS = ["Name a colour:", "Say hello:", "Count to three:", "A word for sea:", "Describe a cat:", "Say yes:"]


def vowel_reward(completions, **kwargs) -> list[float]:
    """The share of a completion's characters that are vowels (a toy reward, written out)."""
    texts = [c if isinstance(c, str) else c[0]["content"] for c in completions]
    return [sum(ch in "aeiou" for ch in t) / max(len(t), 1) for t in texts]


def tiny_model_and_tokenizer(seed: int):
    """A tiny random Qwen3-MoE and a byte-level tokenizer, built locally (no download)."""
    from rpb.testing.models import build_tiny_model
    from rpb.testing.tokenizers import moonlight_tokenizer

    tokenizer = moonlight_tokenizer()
    tokenizer.padding_side = "left"
    return build_tiny_model("qwen3_moe", len(tokenizer), seed=seed).train(), tokenizer


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", help="hub id or local directory (default: a tiny local Qwen3-MoE)")
    parser.add_argument("--output-dir", required=True)
    parser.add_argument("--method", default="kl-to-base", help="anchor.method: sft, lbl, router-l2, kl-to-base, "
                        "logit-l2 or router-freeze (default kl-to-base)")  # fmt: skip
    parser.add_argument("--lambda", dest="lambda_", type=float, default=0.1, help="coefficient of the distance terms")
    parser.add_argument("--lbl-coef", type=float, default=0.01, help="coefficient of lbl")
    parser.add_argument("--replay", default="R3", choices=["off", "R2", "R3", "PR2"], help="routing replay (default R3)")
    parser.add_argument("--rollout-dtype", default="bfloat16", help="'bfloat16' or 'none' (training in float32)")
    parser.add_argument("--max-steps", type=int, default=4)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)

    import datasets

    from rpb.anchors import AnchorConfig, install_anchor
    from rpb.integrations.trl import GRPOConfig, GRPOTrainer
    from rpb.models import load_causal_lm, load_tokenizer

    if args.model:
        model, tokenizer = load_causal_lm(args.model, "bfloat16"), load_tokenizer(args.model)
        tokenizer.padding_side = "left"
    else:
        model, tokenizer = tiny_model_and_tokenizer(args.seed)
    coefficient = {"lambda_": args.lambda_} if args.method in ("router-l2", "kl-to-base", "logit-l2") else {}
    if args.method == "lbl":
        coefficient = {"lbl_coef": args.lbl_coef}
    anchor = install_anchor(model, AnchorConfig(method=args.method, **coefficient))
    config = GRPOConfig(
        output_dir=args.output_dir,
        max_steps=args.max_steps,
        per_device_train_batch_size=4,
        num_generations=4,
        max_completion_length=8 if not args.model else 256,
        num_iterations=2,  # two updates per batch: R2 and the staleness figure need a later update
        learning_rate=1e-3 if not args.model else 1e-6,
        logging_steps=1,
        save_strategy="no",
        report_to=[],
        seed=args.seed,
        bf16=False,
        beta=0.0,
        replay=args.replay,
        rollout_dtype=None if args.rollout_dtype == "none" else args.rollout_dtype,
        use_cpu=not args.model,
        disable_tqdm=True,
    )
    data = datasets.Dataset.from_list([{"prompt": p} for p in PROMPTS])
    trainer = GRPOTrainer(model, vowel_reward, config, data, processing_class=tokenizer, anchor=anchor)
    trainer.train()
    for entry in trainer.state.log_history:
        shown = ("routing/rollout", "routing/stale_mismatch", "pr2/")
        figures = {k: round(v, 4) for k, v in entry.items() if k.startswith(shown) or k == "loss"}
        if figures:
            print(f"step {entry['step']}: {figures}")
    trainer.replay.remove()
    anchor.remove()
    return 0


if __name__ == "__main__":
    sys.exit(main())
