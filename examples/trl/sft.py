"""TRL's SFTTrainer with Router Prior Bias: Moonlight-16B-A3B (or any supported MoE) on the data file
its prior was collected on.

    rpb collect --model moonshotai/Moonlight-16B-A3B --data-jsonl data/train.jsonl \\
        --out prior.safetensors --top-k 6 --max-seq-len 8192 --trust-remote-code
    accelerate launch --num-processes 8 examples/trl/sft.py --model moonshotai/Moonlight-16B-A3B \\
        --data-jsonl data/train.jsonl --prior prior.safetensors --output-dir runs/moonlight-trl

Values marked "paper" are the ones the reference material states; the rest are chosen here.
Any ``SFTConfig`` field can be changed below; ``--method`` picks another anchor (``sft`` is beta 0's
baseline, ``lbl`` rpb's own load-balancing term; TRL's native one stays off).
"""

from __future__ import annotations

import argparse
import sys


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", required=True, help="hub id or local directory of the base model")
    parser.add_argument("--data-jsonl", required=True, help="the very file the prior was collected on")
    parser.add_argument("--prior", help="rpb collect's artifact (methods that read a prior need it)")
    parser.add_argument("--output-dir", required=True)
    parser.add_argument("--method", default="rpb", help="anchor.method (default rpb)")
    parser.add_argument("--beta", type=float, default=1.0, help="paper: 1.0 (see `rpb calibrate` first)")
    parser.add_argument("--lambda", dest="lambda_", type=float, help="coefficient of router-l2 / kl-to-base / logit-l2")
    parser.add_argument("--lbl-coef", type=float, help="coefficient of lbl")
    parser.add_argument("--max-steps", type=int, default=782, help="paper: 782")
    parser.add_argument("--seed", type=int, default=42, help="paper: 42, 43, 44")
    parser.add_argument("--per-device-batch-size", type=int, default=2, help="chosen here (8 GPUs x 2 x 8 = 128)")
    parser.add_argument("--grad-accum", type=int, default=8, help="chosen here (global batch 128: paper)")
    parser.add_argument("--lr", type=float, default=5e-6, help="chosen here")
    parser.add_argument("--dtype", default="bfloat16", help="chosen here")
    parser.add_argument("--trust-remote-code", action="store_true", help="for the tokenizer (Moonlight's)")
    args = parser.parse_args(argv)

    import torch

    from rpb.anchors import AnchorConfig
    from rpb.integrations.trl import SFTConfig, SFTTrainer, prepare
    from rpb.models import load_causal_lm, load_tokenizer

    tokenizer = load_tokenizer(args.model, args.trust_remote_code)
    model = load_causal_lm(args.model, args.dtype)
    anchor = AnchorConfig(method=args.method, beta=args.beta, lambda_=args.lambda_, lbl_coef=args.lbl_coef)
    # checks the prior against this model, tokenizer and data file (rpb train's errors), then installs the anchor
    handle, rows = prepare(model, tokenizer, args.data_jsonl, anchor, args.prior, model_id=args.model)
    config = SFTConfig(
        output_dir=args.output_dir,
        max_steps=args.max_steps,
        seed=args.seed,
        per_device_train_batch_size=args.per_device_batch_size,
        gradient_accumulation_steps=args.grad_accum,
        learning_rate=args.lr,
        lr_scheduler_type="cosine",  # chosen here
        warmup_steps=50,  # chosen here
        bf16=args.dtype == "bfloat16" and torch.cuda.is_available(),
        logging_steps=10,
        save_strategy="no",
        report_to=[],
    )  # router_aux_loss_coef stays 0.0: no native load-balancing loss under any method
    trainer = SFTTrainer(model, config, rows, anchor=handle, processing_class=tokenizer)
    try:
        trainer.train()
    finally:
        handle.remove()
    trainer.save_model(args.output_dir)  # plain transformers: from_pretrained loads it without rpb
    tokenizer.save_pretrained(args.output_dir)
    return 0


if __name__ == "__main__":
    sys.exit(main())
