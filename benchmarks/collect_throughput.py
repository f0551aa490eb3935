"""Collector throughput against a plain forward pass, on a Moonlight-shaped tiny MoE.

``rpb collect`` runs the frozen base model without its LM head and reads the routers
through forward hooks, so collecting a prior should never cost more than a forward
pass. This benchmark builds a Moonlight-shaped (DeepSeek-V3) MoE with a realistic
vocabulary-to-width ratio, saves it with the Moonlight tokenizer, labels a synthetic
multi-turn chat file, and times on that checkpoint and on the same batches:

* collect: ``load_base_model`` + ``collect_prior`` (only the ``collect_prior`` pass);
* forward: ``AutoModelForCausalLM`` under ``torch.inference_mode()``, one
  ``model(input_ids, attention_mask, use_cache=False)`` per batch, vocabulary logits
  included (only the loop; it collates its batches as ``collect_prior`` does).

Tokens are non-padding tokens. After one warm-up pass of each, the repeats alternate
collect and forward; the medians are reported. Target: collect / forward >= 1. The
last line printed is one JSON object; the exit status is 0 whether the target holds or not.

Run: .venv/bin/python benchmarks/collect_throughput.py [--rows 48 --batch-size 8 --threads 2 ...]
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import tempfile
import time
from pathlib import Path

import torch
from transformers import AutoModelForCausalLM

from rpb.adapters import find_moe_layers, get_adapter
from rpb.collect import batches, collect_prior, load_base_model, load_tokenizer
from rpb.data import collate, load_labelled
from rpb.toy.data import conversations, write_jsonl
from rpb.toy.models import build_tiny_model
from rpb.toy.tokenizers import moonlight_tokenizer


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--rows", type=int, default=48, help="conversations in the data file")
    p.add_argument("--max-seq-len", type=int, default=512)
    p.add_argument("--batch-size", type=int, default=8)
    p.add_argument("--repeats", type=int, default=3, help="timed passes of each, after one warm-up")
    p.add_argument("--hidden-size", type=int, default=256)
    p.add_argument("--vocab-size", type=int, default=32768)
    p.add_argument("--threads", type=int, default=None, help="torch.set_num_threads (default: as is)")
    p.add_argument("--transform", default="softmax", choices=["softmax", "sigmoid-normalized"])
    p.add_argument("--seed", type=int, default=0)
    return p.parse_args()


def write_data(path: Path, rows: int, seed: int) -> None:
    """Rows of 4 to 10 exchanges (about 200 to 550 tokens with the Moonlight template)."""
    rng = random.Random(seed)
    exchanges = iter(conversations(rows * 10, seed, multi_turn_every=0))
    data = []
    for _ in range(rows):
        messages = [m for _ in range(rng.randint(4, 10)) for m in next(exchanges)["messages"]]
        data.append({"messages": messages})
    write_jsonl(data, path)


def time_collect(model, layers, examples, args, pad_id) -> float:
    started = time.perf_counter()
    collect_prior(model, layers, examples, args.transform, args.batch_size, pad_id, progress=False)
    return time.perf_counter() - started


@torch.inference_mode()
def time_forward(model, examples, args, pad_id) -> float:
    started = time.perf_counter()
    for batch in batches(examples, args.batch_size):
        b = collate(batch, pad_id)
        model(input_ids=b["input_ids"], attention_mask=b["attention_mask"], use_cache=False)
    return time.perf_counter() - started


def main() -> None:
    args = parse_args()
    if args.vocab_size < 32768:
        raise SystemExit("--vocab-size must be >= 32768 (a realistic vocabulary-to-width ratio)")
    if args.threads:
        torch.set_num_threads(args.threads)
    with tempfile.TemporaryDirectory(prefix="rpb-bench-") as tmp:
        model_dir, data_path = Path(tmp) / "model", Path(tmp) / "data.jsonl"
        shape = {
            "hidden_size": args.hidden_size,
            "num_hidden_layers": 4,
            "num_attention_heads": 4,
            "num_key_value_heads": 4,
            "kv_lora_rank": 64,
            "qk_nope_head_dim": 32,
            "qk_rope_head_dim": 16,
            "v_head_dim": 32,
            "intermediate_size": 2 * args.hidden_size,
            "moe_intermediate_size": 64,
            "n_routed_experts": 64,
            "num_experts_per_tok": 6,
        }
        build_tiny_model("moonlight", args.vocab_size, args.seed, **shape).save_pretrained(model_dir)
        moonlight_tokenizer().save_pretrained(model_dir)
        write_data(data_path, args.rows, args.seed)

        tokenizer = load_tokenizer(str(model_dir))
        examples = load_labelled(data_path, tokenizer, args.max_seq_len).examples
        pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else 0
        tokens = sum(len(e) for e in examples)  # collate pads on the right: exactly the unmasked tokens
        padded = sum(len(b) * max(len(e) for e in b) for b in batches(examples, args.batch_size))

        base = load_base_model(str(model_dir))
        layers = find_moe_layers(base, get_adapter(base.config.model_type))
        full = AutoModelForCausalLM.from_pretrained(model_dir).eval()
        cfg = full.config
        print(
            f"model: {cfg.model_type}, hidden {cfg.hidden_size}, vocab {cfg.vocab_size}, "
            f"{cfg.num_hidden_layers} layers ({len(layers)} MoE, {cfg.n_routed_experts} experts, top-{cfg.num_experts_per_tok})"
        )
        print(
            f"attention {base.config._attn_implementation}/{cfg._attn_implementation}, "
            f"experts {getattr(base.config, '_experts_implementation', None)}/{getattr(cfg, '_experts_implementation', None)}"
            " (collect/forward)"
        )
        print(
            f"data: {len(examples)} rows, {tokens} tokens (mean {tokens / len(examples):.0f}, "
            f"max {max(len(e) for e in examples)}), batch {args.batch_size}, {tokens / padded:.0%} of padded positions"
        )
        print(f"threads: {torch.get_num_threads()}, transform: {args.transform}")

        time_collect(base, layers, examples, args, pad_id)  # warm-up
        time_forward(full, examples, args, pad_id)
        collect_s, forward_s = [], []
        for i in range(args.repeats):
            collect_s.append(time_collect(base, layers, examples, args, pad_id))
            forward_s.append(time_forward(full, examples, args, pad_id))
            print(
                f"repeat {i + 1}: collect {tokens / collect_s[-1]:,.0f} tok/s ({collect_s[-1]:.2f} s), "
                f"forward {tokens / forward_s[-1]:,.0f} tok/s ({forward_s[-1]:.2f} s)"
            )

    collect_tps = tokens / statistics.median(collect_s)
    forward_tps = tokens / statistics.median(forward_s)
    ratio = collect_tps / forward_tps
    print(f"median: collect {collect_tps:,.0f} tok/s, forward {forward_tps:,.0f} tok/s, ratio {ratio:.2f}")
    print(f"target collect/forward >= 1.0: {'holds' if ratio >= 1.0 else 'MISSED'}")
    result = {
        "collect_tokens_per_s": round(collect_tps, 1),
        "forward_tokens_per_s": round(forward_tps, 1),
        "ratio": round(ratio, 4),
        "vocab_size": args.vocab_size,
        "hidden_size": args.hidden_size,
        "rows": len(examples),
        "tokens": tokens,
        "batch_size": args.batch_size,
        "repeats": args.repeats,
        "max_seq_len": args.max_seq_len,
        "threads": torch.get_num_threads(),
        "transform": args.transform,
    }
    print(json.dumps(result))


if __name__ == "__main__":
    main()
