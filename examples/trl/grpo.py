"""GRPO with TRL on an MoE model, the routing held: a loss anchor, routing replay, and the rollout-vs-training
mismatch logged every step (docs/rl.md).

    python examples/trl/grpo.py --output-dir runs/grpo-tiny            # a tiny local Qwen3-MoE, on the CPU
    python examples/trl/grpo.py --output-dir runs/grpo-kd --method routing-kd --target 0.9 --beta 0.04 --replay off
    accelerate launch examples/trl/grpo.py --model Qwen/Qwen3-30B-A3B --output-dir runs/grpo-qwen3 \\
        --method kl-to-base --lambda 0.1 --replay R3 --max-steps 200

``--lambda`` is the coefficient of every method that takes one (``--lbl-coef`` is lbl's); for ``routing-kd``,
``--target`` says what to hold instead (the overlap with the base's top-k; λ steered at every update, ``--lambda``
where it starts; with ``--replay off``, as docs/rl.md explains), which means the same under every transform where a
λ does not (docs/methods.md). ``--beta`` is GRPO's KL
to the reference model, whose forward ``routing-kd`` reuses for the base's routing (so under full fine-tuning
``routing-kd`` needs ``--beta`` > 0). A method that reads a prior (rpb, rpb-hard and the shuffled controls) takes
``--prior`` and ``--prompts``: the prompts file in rpb's data format and its prior from ``rpb collect``, labelled
by ``prepare_grpo`` (docs/rl.md, "RPB in RL"); it replaces this file's prompts. ``output-kd`` is refused by name,
as GRPO refuses it: TRL's ``--beta`` is that term.

The reward is written here: it counts the vowels of a completion, so that a tiny random model has something to
learn on the CPU; replace ``vowel_reward`` (and the prompts) with a real task's. TRL's native load-balancing
loss stays off in every mode; ``--method lbl`` is rpb's own term.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

PROMPTS = ["Name a colour:", "Say hello:", "Count to three:", "A word for sea:", "Describe a cat:", "Say yes:"]


def vowel_reward(completions, **kwargs) -> list[float]:
    """The share of a completion's characters that are vowels (a toy reward, written out)."""
    texts = [c if isinstance(c, str) else c[0]["content"] for c in completions]
    return [sum(ch in "aeiou" for ch in t) / max(len(t), 1) for t in texts]


def tiny_model_and_tokenizer(seed: int, where: Path):
    """A tiny random Qwen3-MoE and a byte-level tokenizer, built locally (no download) and saved to ``where``, then
    loaded from there as a real checkpoint is: GRPO with ``--beta`` > 0 builds its reference model from the path."""
    from transformers import AutoModelForCausalLM

    from rpb.testing.models import build_tiny_model
    from rpb.testing.tokenizers import moonlight_tokenizer

    tokenizer = moonlight_tokenizer()
    tokenizer.padding_side = "left"
    build_tiny_model("qwen3_moe", len(tokenizer), seed=seed).save_pretrained(where)
    tokenizer.save_pretrained(where)
    return AutoModelForCausalLM.from_pretrained(where).train(), tokenizer


def main(argv: list[str] | None = None) -> int:
    from rpb.anchors import METHODS

    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", help="hub id or local directory (default: a tiny local Qwen3-MoE)")
    parser.add_argument("--dtype", default="bfloat16", help="the --model's dtype (default bfloat16)")
    parser.add_argument("--output-dir", required=True)
    parser.add_argument("--method", default="kl-to-base", choices=sorted(METHODS), help="anchor.method (default "
                        "kl-to-base); one that reads a prior takes --prior and --prompts")  # fmt: skip
    parser.add_argument("--lambda", dest="lambda_", type=float, help="coefficient of the method's term (default 0.1; "
                        "with --target, where λ starts: default 1)")  # fmt: skip
    parser.add_argument("--target", type=float, help="routing-kd: the overlap with the base to hold (anchor.target)")
    parser.add_argument("--lbl-coef", type=float, default=0.01, help="coefficient of lbl")
    parser.add_argument("--beta", type=float, default=0.0, help="GRPO's KL to the reference model (default 0)")
    parser.add_argument("--prior", help="prior file (rpb collect over --prompts), for a method that reads one")
    parser.add_argument("--prompts", help="prompts file in rpb's data format, each row ending in a reference answer")
    parser.add_argument("--rpb-beta", type=float, default=1.0, help="anchor.beta of a prior-reading method")
    parser.add_argument("--replay", default="R3", choices=["off", "R2", "R3", "PR2"], help="routing replay")
    parser.add_argument("--rollout-dtype", default="bfloat16", help="'bfloat16' or 'none' (training in float32)")
    parser.add_argument("--max-steps", type=int, default=4)
    parser.add_argument("--max-completion-length", type=int, help="default 8 on the tiny model, else 256")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    method = METHODS[args.method]
    if method.needs_prior and not (args.prior and args.prompts):
        parser.error(
            f"--method {args.method} reads a prior: give --prior and --prompts (the prompts file in rpb's data "
            "format and its prior from rpb collect; docs/rl.md, 'RPB in RL')"
        )
    if (args.prior or args.prompts) and not method.needs_prior:
        parser.error(f"--prior and --prompts are for a method that reads a prior; {args.method} reads none")

    import datasets

    from rpb.anchors import AnchorConfig, install_anchor
    from rpb.errors import RpbError
    from rpb.integrations.trl import GRPOConfig, GRPOTrainer, prepare_grpo
    from rpb.models import load_causal_lm, load_tokenizer

    if args.model:
        model, tokenizer = load_causal_lm(args.model, args.dtype), load_tokenizer(args.model)
        tokenizer.padding_side = "left"
    else:
        model, tokenizer = tiny_model_and_tokenizer(args.seed, Path(args.output_dir) / "tiny-base")
    if args.target is not None and args.method != "routing-kd":
        parser.error(f"--target is routing-kd's (the routing it holds); {args.method} measures no routing")
    coefficient = {}  # forwarded to every method that takes one; sft and router-freeze take none
    if args.target is not None:
        coefficient = {"target": args.target} | ({"lambda_": args.lambda_} if args.lambda_ is not None else {})
    elif method.coefficient is not None:
        lam = 0.1 if args.lambda_ is None else args.lambda_
        coefficient[method.coefficient] = args.lbl_coef if args.method == "lbl" else lam
    config = GRPOConfig(
        output_dir=args.output_dir,
        max_steps=args.max_steps,
        per_device_train_batch_size=4,
        num_generations=4,
        max_completion_length=args.max_completion_length or (8 if not args.model else 256),
        num_iterations=2,  # two updates per batch: R2 and the staleness figure need a later update
        learning_rate=1e-3 if not args.model else 1e-6,
        logging_steps=1,
        save_strategy="no",
        report_to=[],
        seed=args.seed,
        bf16=False,
        beta=args.beta,
        replay=args.replay,
        rollout_dtype=None if args.rollout_dtype == "none" else args.rollout_dtype,
        use_cpu=not args.model,
        disable_tqdm=True,
    )
    try:
        if method.needs_prior:
            anchor_config = AnchorConfig(method=args.method, beta=args.rpb_beta)
            anchor, data = prepare_grpo(model, tokenizer, args.prompts, anchor_config, args.prior)
        else:
            anchor = install_anchor(model, AnchorConfig(method=args.method, **coefficient))
            data = datasets.Dataset.from_list([{"prompt": p} for p in PROMPTS])
        try:
            trainer = GRPOTrainer(model, vowel_reward, config, data, processing_class=tokenizer, anchor=anchor)
        except RpbError:
            anchor.remove()
            raise
    except RpbError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    trainer.train()
    for entry in trainer.state.log_history:
        shown = ("routing/rollout", "routing/stale_mismatch", "pr2/", "anchor/")
        figures = {k: round(v, 4) for k, v in entry.items() if k.startswith(shown) or k == "loss"}
        if figures:
            print(f"step {entry['step']}: {figures}")
    trainer.replay.remove()
    anchor.remove()
    return 0


if __name__ == "__main__":
    sys.exit(main())
