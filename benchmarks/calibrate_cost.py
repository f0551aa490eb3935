"""What ``rpb calibrate`` costs, as multiples of one ``rpb collect`` pass over the same rows.

On a Moonlight-shaped MoE (the checkpoint and data of ``collect_throughput.py``: 64 experts top-6,
hidden 256, vocabulary 32,768, multi-turn chats), with the prior collected first, this times on
the same rows and the same length-bucketed batches:

* collect: ``collect_prior`` (the collector's forward with its span hooks), the unit;
* counterfactual: ``rpb calibrate``'s first pass for five betas: one unbiased forward per batch,
  then every beta's choice layer by layer on the captured logits, plus the prior's agreement;
* propagated: its second pass: per batch the unbiased forward and one forward per beta with the
  bias at every MoE layer (six forwards).

After one warm-up of each, the repeats alternate; medians are reported. Targets: ``ratio``
(counterfactual / collect) <= 1.5 and ``ratio_propagated`` (propagated / collect) <= 1.2 x 6.
The last line printed is one JSON object; the exit status is 0 whether the targets hold or not.

``--smoke`` times one repeat of each on 4 short rows, hidden 64, and judges no target: a check that the script
runs, not a measurement.

Run: .venv/bin/python benchmarks/calibrate_cost.py [--rows 48 --batch-size 8 --threads 2 ...] [--smoke]
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time
from pathlib import Path

import torch
from transformers.utils import logging as hf_logging

from rpb.adapters import find_moe_layers
from rpb.anchors import AnchorConfig, install_anchor
from rpb.calibrate.run import Counter, Sample, counterfactual_pass, propagated_pass
from rpb.collect import collect, collect_prior
from rpb.collect.rows import label_range, scan_rows
from rpb.data import ChatTemplate
from rpb.models import load_base_model, load_tokenizer, pad_id_of
from rpb.prior.artifact import load_artifact
from rpb.testing.data import long_conversations, write_jsonl
from rpb.testing.models import build_tiny_model
from rpb.testing.tokenizers import moonlight_tokenizer

MLA = dict(kv_lora_rank=64, qk_nope_head_dim=32, qk_rope_head_dim=16, v_head_dim=32)
MOE = dict(num_hidden_layers=4, moe_intermediate_size=64, n_routed_experts=64, num_experts_per_tok=6)
BETAS = (0.25, 0.5, 1.0, 2.0, 4.0)
#: --smoke: one repeat on a few short rows of a narrower model (an option given explicitly still wins)
SMOKE = dict(rows=4, max_seq_len=128, batch_size=2, repeats=1, hidden_size=64)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--rows", type=int, default=48)
    p.add_argument("--max-seq-len", type=int, default=512)
    p.add_argument("--batch-size", type=int, default=8)
    p.add_argument("--repeats", type=int, default=5, help="timed passes of each, after one warm-up")
    p.add_argument("--hidden-size", type=int, default=256)
    p.add_argument("--vocab-size", type=int, default=32768)
    p.add_argument("--threads", type=int, default=None, help="torch.set_num_threads (default: as is)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--smoke", action="store_true", help="one repeat on 4 short rows, no target judged")
    args = p.parse_args(argv)
    if args.smoke:  # again, on the smoke defaults: an option given explicitly still wins
        p.set_defaults(**SMOKE)
        args = p.parse_args(argv)
    return args


def build(tmp: Path, args) -> tuple[Path, Path, Path]:
    model_dir, data_path, prior = tmp / "model", tmp / "data.jsonl", tmp / "prior.safetensors"
    shape = {**MLA, **MOE, "hidden_size": args.hidden_size, "intermediate_size": 2 * args.hidden_size}
    build_tiny_model("moonlight", args.vocab_size, args.seed, **shape).save_pretrained(model_dir)
    moonlight_tokenizer().save_pretrained(model_dir)
    write_jsonl(long_conversations(args.rows, args.seed), data_path)
    collect(str(model_dir), data_path, prior, top_k=MOE["num_experts_per_tok"], max_seq_len=args.max_seq_len,
            batch_size=args.batch_size, progress=False)  # fmt: skip
    return model_dir, data_path, prior


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    hf_logging.disable_progress_bar()
    with tempfile.TemporaryDirectory(prefix="rpb-bench-", ignore_cleanup_errors=True) as tmp:
        model_dir, data_path, prior = build(Path(tmp), args)
        tokenizer = load_tokenizer(str(model_dir))
        template = ChatTemplate(tokenizer)
        rows = scan_rows(data_path, template, args.max_seq_len)
        examples = label_range(rows, template, args.max_seq_len, 0, rows.num_rows)
        artifact = load_artifact(prior)
        base, facts = load_base_model(str(model_dir))
        layers = find_moe_layers(base, facts)
        pad_id = pad_id_of(tokenizer)
        indices = list(range(rows.num_rows))
        sample = Sample(indices, examples, artifact.prior_qa[indices])
        handles = [install_anchor(base, AnchorConfig(method="rpb", beta=b), prior=artifact.prior_qa) for b in BETAS]

        def run_collect():
            collect_prior(base, layers, examples, "softmax", args.batch_size, pad_id, progress=False)

        def run_counterfactual():
            counter = Counter(len(BETAS), len(indices), len(layers))
            counterfactual_pass(base, layers, handles, sample, counter, "softmax", args.batch_size, pad_id, False)

        def run_propagated():
            counter = Counter(len(BETAS), len(indices), len(layers))
            propagated_pass(base, layers, handles, sample, counter, args.batch_size, pad_id, False)

        passes = {"collect": run_collect, "counterfactual": run_counterfactual, "propagated": run_propagated}
        for fn in passes.values():  # warm-up
            fn()
        seconds: dict[str, list[float]] = {name: [] for name in passes}
        for i in range(args.repeats):
            for name, fn in passes.items():
                started = time.perf_counter()
                fn()
                seconds[name].append(time.perf_counter() - started)
            print(f"repeat {i + 1}: " + ", ".join(f"{n} {s[-1]:.2f} s" for n, s in seconds.items()))
        tokens = sum(len(e) for e in examples)
    median = {name: statistics.median(s) for name, s in seconds.items()}
    ratio = median["counterfactual"] / median["collect"]
    ratio_propagated = median["propagated"] / median["collect"]
    for name, value, target in (("counterfactual", ratio, 1.5), ("propagated", ratio_propagated, 1.2 * 6)):
        verdict = "--smoke: no target judged" if args.smoke else f"target <= {target:g}: "
        verdict += "" if args.smoke else "holds" if value <= target else "MISSED"
        print(f"{name} / collect {value:.3f} ({verdict})")
    result = {"ratio": round(ratio, 4), "ratio_propagated": round(ratio_propagated, 4), "betas": list(BETAS)}
    result |= {f"median_s_{n}": round(v, 4) for n, v in median.items()}
    result |= {"rows": len(examples), "tokens": tokens, "batch_size": args.batch_size, "repeats": args.repeats}
    result |= {"layers": len(layers), "experts": MOE["n_routed_experts"], "threads": torch.get_num_threads()}
    result |= {"smoke": True} if args.smoke else {}  # a smoke run's figures are no measurement
    print(json.dumps(result))


if __name__ == "__main__":
    main()
