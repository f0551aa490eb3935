"""Collector throughput against a plain forward pass, on a Moonlight-shaped tiny MoE.

``rpb collect`` runs the frozen base model without its LM head and reads the routers
through forward hooks, so collecting a prior should never cost more than a forward
pass. This benchmark builds a Moonlight-shaped (DeepSeek-V3) MoE with a realistic
vocabulary-to-width ratio, saves it with the Moonlight tokenizer, labels a synthetic
multi-turn chat file, and times on that checkpoint and on the same batches:

* collect: what ``rpb collect`` does per chunk after loading (``load_base_model``) and
  checking the data (``scan_rows``): read the chunk's rows back and label them
  (``label_range``), ``collect_prior`` (length-bucketed batches), write the chunk file to
  the work directory, and at the end assemble the artifact from the chunks;
* forward: ``AutoModelForCausalLM`` under ``torch.inference_mode()``, one
  ``model(input_ids, attention_mask, use_cache=False)`` per batch, vocabulary logits
  included, on the batches ``collect_prior`` forms (``plan_batches`` over each chunk;
  only the loop, on rows labelled beforehand).

Tokens are non-padding tokens. After one warm-up pass of each, the repeats alternate
collect and forward; the medians are reported. Target: collect / forward >= 1. The
last line printed is one JSON object; the exit status is 0 whether the target holds or not.

``--smoke`` times one repeat of each on 4 short rows, hidden 64, and judges no target: a check that the script
runs, not a measurement.

Run: .venv/bin/python benchmarks/collect_throughput.py [--rows 48 --batch-size 8 --threads 2 ...] [--smoke]
"""

from __future__ import annotations

import argparse
import json
import shutil
import statistics
import tempfile
import time
from pathlib import Path

import torch
from transformers import AutoModelForCausalLM
from transformers.utils import logging as hf_logging

from rpb.adapters import find_moe_layers
from rpb.collect import DEFAULT_CHUNK_ROWS, collect_prior, plan_batches
from rpb.collect.rows import label_range, scan_rows
from rpb.collect.store import WorkDir
from rpb.data import ChatTemplate, collate
from rpb.models import load_base_model, load_tokenizer
from rpb.testing.data import long_conversations, write_jsonl
from rpb.testing.models import build_tiny_model
from rpb.testing.tokenizers import moonlight_tokenizer

#: Moonlight's layout at a small width: MLA attention, 64 routed experts (top-6), shared experts, dense first layer.
MLA = dict(kv_lora_rank=64, qk_nope_head_dim=32, qk_rope_head_dim=16, v_head_dim=32)
MOE = dict(num_hidden_layers=4, moe_intermediate_size=64, n_routed_experts=64, num_experts_per_tok=6)
#: --smoke: one repeat on a few short rows of a narrower model (an option given explicitly still wins)
SMOKE = dict(rows=4, max_seq_len=128, batch_size=2, repeats=1, hidden_size=64)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--rows", type=int, default=48, help="conversations in the data file")
    p.add_argument("--max-seq-len", type=int, default=512)
    p.add_argument("--batch-size", type=int, default=8)
    p.add_argument("--chunk-rows", type=int, default=DEFAULT_CHUNK_ROWS)
    p.add_argument("--no-bucket", action="store_true", help="batch in file order, as before bucketing")
    p.add_argument("--repeats", type=int, default=5, help="timed passes of each, after one warm-up")
    p.add_argument("--hidden-size", type=int, default=256)
    p.add_argument("--vocab-size", type=int, default=32768)
    p.add_argument("--threads", type=int, default=None, help="torch.set_num_threads (default: as is)")
    p.add_argument("--transform", default="softmax", choices=["softmax", "sigmoid-normalized"])
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--smoke", action="store_true", help="one repeat on 4 short rows, no target judged")
    args = p.parse_args(argv)
    if args.smoke:  # again, on the smoke defaults: an option given explicitly still wins
        p.set_defaults(**SMOKE)
        args = p.parse_args(argv)
    return args


def write_data(path: Path, rows: int, seed: int) -> None:
    write_jsonl(long_conversations(rows, seed), path)


def time_collect(model, layers, rows, template, out: Path, args, pad_id) -> float:
    """The streamed collection into ``out`` (its work directory is made afresh each time)."""
    run = {"num_rows": rows.num_rows, "benchmark": True}
    store = WorkDir(out, run, args.chunk_rows)
    shutil.rmtree(store.path, ignore_errors=True)
    started = time.perf_counter()
    store.prepare()
    for a, b in store.chunks:
        examples = label_range(rows, template, args.max_seq_len, a, b)
        prior, counts = collect_prior(
            model, layers, examples, args.transform, args.batch_size, pad_id, progress=False, bucket=not args.no_bucket
        )
        store.write_chunk(a, b, prior, counts, rows.row_sha256(a, b))
    store.assemble(run, len(layers), prior.shape[-1], rows.digests)
    store.remove()
    return time.perf_counter() - started


def forward_batches(examples, args) -> list[list]:
    """The batches ``collect_prior`` forms: per chunk, ``plan_batches`` over the chunk's rows."""
    out = []
    for start in range(0, len(examples), args.chunk_rows):
        chunk = examples[start : start + args.chunk_rows]
        plan = plan_batches([len(e) for e in chunk], args.batch_size, bucket=not args.no_bucket)
        out += [[chunk[i] for i in positions] for positions in plan]
    return out


@torch.inference_mode()
def time_forward(model, batch_list, pad_id) -> float:
    started = time.perf_counter()
    for batch in batch_list:
        b = collate(batch, pad_id)
        model(input_ids=b["input_ids"], attention_mask=b["attention_mask"], use_cache=False)
    return time.perf_counter() - started


def build(tmp: Path, args) -> tuple[Path, Path]:
    """The checkpoint (model + tokenizer) and the data file, written under ``tmp``."""
    model_dir, data_path = tmp / "model", tmp / "data.jsonl"
    shape = {**MLA, **MOE, "hidden_size": args.hidden_size, "intermediate_size": 2 * args.hidden_size}
    build_tiny_model("moonlight", args.vocab_size, args.seed, **shape).save_pretrained(model_dir)
    moonlight_tokenizer().save_pretrained(model_dir)
    write_data(data_path, args.rows, args.seed)
    return model_dir, data_path


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    if args.vocab_size < 32768:
        raise SystemExit("--vocab-size must be >= 32768 (a realistic vocabulary-to-width ratio)")
    if args.threads:
        torch.set_num_threads(args.threads)
    hf_logging.disable_progress_bar()
    with tempfile.TemporaryDirectory(prefix="rpb-bench-", ignore_cleanup_errors=True) as tmp:
        model_dir, data_path = build(Path(tmp), args)
        tokenizer = load_tokenizer(str(model_dir))
        template = ChatTemplate(tokenizer)
        rows = scan_rows(data_path, template, args.max_seq_len)
        examples = label_range(rows, template, args.max_seq_len, 0, rows.num_rows)
        pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else 0
        base, facts = load_base_model(str(model_dir))
        layers = find_moe_layers(base, facts)
        full = AutoModelForCausalLM.from_pretrained(model_dir).eval()
        out = Path(tmp) / "prior.safetensors"
        batch_list = forward_batches(examples, args)
        tokens = sum(len(e) for e in examples)  # collate pads on the right: exactly the unmasked tokens
        padded = sum(len(b) * max(len(e) for e in b) for b in batch_list)
        report(full, base, layers, examples, tokens, padded, args)
        collect_tps, forward_tps = measure(base, layers, rows, template, out, full, batch_list, tokens, pad_id, args)

    ratio = collect_tps / forward_tps
    print(f"median: collect {collect_tps:,.0f} tok/s, forward {forward_tps:,.0f} tok/s, ratio {ratio:.2f}")
    if not args.smoke:
        print(f"target collect/forward >= 1.0: {'holds' if ratio >= 1.0 else 'MISSED'}")
    result = {"collect_tokens_per_s": round(collect_tps, 1), "forward_tokens_per_s": round(forward_tps, 1)}
    result |= {"ratio": round(ratio, 4), "vocab_size": args.vocab_size, "hidden_size": args.hidden_size}
    result |= {"rows": len(examples), "tokens": tokens, "batch_size": args.batch_size, "repeats": args.repeats}
    result |= {
        "chunk_rows": args.chunk_rows,
        "bucket": not args.no_bucket,
        "padded_fraction": round(tokens / padded, 4),
    }
    result |= {"max_seq_len": args.max_seq_len, "threads": torch.get_num_threads(), "transform": args.transform}
    result |= {"smoke": True} if args.smoke else {}  # a smoke run's figures are no measurement
    print(json.dumps(result))


def report(full, base, layers, examples, tokens, padded, args) -> None:
    c = full.config
    print(f"model: {c.model_type}, hidden {c.hidden_size}, vocab {c.vocab_size}, {c.num_hidden_layers} layers", end="")
    print(f" ({len(layers)} MoE, {c.n_routed_experts} experts, top-{c.num_experts_per_tok})")
    for name, m in (("collect", base), ("forward", full)):
        experts = getattr(m.config, "_experts_implementation", None)
        dtype = next(m.parameters()).dtype
        print(f"{name}: {type(m).__name__}, {dtype}, attention {m.config._attn_implementation}, experts {experts}")
    print(
        f"data: {len(examples)} rows, {tokens} tokens (mean {tokens / len(examples):.0f}, "
        f"max {max(len(e) for e in examples)}), batch {args.batch_size}, chunk {args.chunk_rows} rows, "
        f"{'length-bucketed' if not args.no_bucket else 'file order'}, {tokens / padded:.0%} of padded positions"
    )
    print(f"threads: {torch.get_num_threads()}, transform: {args.transform}")


def measure(base, layers, rows, template, out, full, batch_list, tokens, pad_id, args) -> tuple[float, float]:
    """Median tokens/s of each, after one warm-up pass of each, the repeats alternating."""
    time_collect(base, layers, rows, template, out, args, pad_id)  # warm-up
    time_forward(full, batch_list, pad_id)
    collect_s, forward_s = [], []
    for i in range(args.repeats):
        collect_s.append(time_collect(base, layers, rows, template, out, args, pad_id))
        forward_s.append(time_forward(full, batch_list, pad_id))
        print(
            f"repeat {i + 1}: collect {tokens / collect_s[-1]:,.0f} tok/s ({collect_s[-1]:.2f} s), "
            f"forward {tokens / forward_s[-1]:,.0f} tok/s ({forward_s[-1]:.2f} s)"
        )
    return tokens / statistics.median(collect_s), tokens / statistics.median(forward_s)


if __name__ == "__main__":
    main()
