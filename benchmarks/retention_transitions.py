"""What the fourth retention level (``--transitions``) costs: the streaming pass with and without it.

Two Moonlight-shaped (DeepSeek-V3) tiny MoEs, base and post, route a labelled synthetic chat file
through ``collect_routing`` (the pass ``rpb retention`` streams; model loading, labelling and the
Louvain report are left out, as in ``retention_scaling.py``):

* ``plain``: without transitions, 1x rows;
* ``trans``: with transitions, 1x rows;
* ``trans2``: with transitions, the 1x rows twice (exactly twice the batches, the same shapes).

After an untimed warm-up the three alternate (the order rotates every repeat) and the medians are
reported. Targets: ``ratio_2x`` = trans2 / trans in [1.8, 2.3] (linear in the tokens) and
``ratio_transitions`` = trans / plain <= 1.3. The transition counts are checked to double
exactly at 2x. ``report_seconds`` times ``build_report`` with transitions once (directed Louvain per
layer and model: independent of the number of tokens).

The last line printed is one JSON object; the exit status is 0 whether the targets hold or not.

``--smoke`` times one repeat on 2 short rows, 8 experts top-2, and judges no target: a check that the script
runs, not a measurement.

Run: .venv/bin/python benchmarks/retention_transitions.py [--rows 32 --repeats 5 --threads 2 ...] [--smoke]
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
from rpb.data import load_labelled
from rpb.models import load_base_model, load_tokenizer
from rpb.retention.run import build_report, collect_routing
from rpb.testing.data import long_conversations, write_jsonl
from rpb.testing.models import build_tiny_model
from rpb.testing.tokenizers import moonlight_tokenizer

MLA = dict(kv_lora_rank=64, qk_nope_head_dim=32, qk_rope_head_dim=16, v_head_dim=32)
#: --smoke: one repeat on a few short rows, fewer experts (an option given explicitly still wins)
SMOKE = dict(rows=2, max_seq_len=128, batch_size=2, repeats=1, experts=8, top_k=2)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--rows", type=int, default=32)
    p.add_argument("--max-seq-len", type=int, default=512)
    p.add_argument("--batch-size", type=int, default=8)
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--experts", type=int, default=64)
    p.add_argument("--top-k", type=int, default=6)
    p.add_argument("--threads", type=int, default=None)
    p.add_argument("--smoke", action="store_true", help="one repeat on 2 short rows, no target judged")
    args = p.parse_args(argv)
    if args.smoke:  # again, on the smoke defaults: an option given explicitly still wins
        p.set_defaults(**SMOKE)
        args = p.parse_args(argv)
    return args


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    hf_logging.set_verbosity_error()
    if args.threads:
        torch.set_num_threads(args.threads)
    shape = {**MLA, "hidden_size": 128, "intermediate_size": 256, "num_hidden_layers": 4, "moe_intermediate_size": 64,
             "n_routed_experts": args.experts, "num_experts_per_tok": args.top_k}  # fmt: skip
    with tempfile.TemporaryDirectory() as tmp:
        dirs = [Path(tmp) / "base", Path(tmp) / "post"]
        for seed, d in zip((0, 1000), dirs, strict=True):
            build_tiny_model("moonlight", 1024, seed, **shape).save_pretrained(d)
            moonlight_tokenizer().save_pretrained(d)
        write_jsonl(long_conversations(args.rows, 0), Path(tmp) / "data.jsonl")
        tok = load_tokenizer(str(dirs[0]))
        examples = load_labelled(Path(tmp) / "data.jsonl", tok, args.max_seq_len).examples
        models, layers = [], []
        for d in dirs:
            model, facts = load_base_model(str(d), "float32", None, "cpu")
            models.append(model)
            layers.append(find_moe_layers(model, facts))

    def run(rows, transitions):
        started = time.perf_counter()
        stats, overlap = collect_routing(models, layers, rows, args.batch_size, 0, False, transitions)
        return time.perf_counter() - started, stats, overlap

    cases = {"plain": (examples, False), "trans": (examples, True), "trans2": (examples + examples, True)}
    for rows, transitions in cases.values():
        run(rows, transitions)  # warm-up
    seconds: dict[str, list[float]] = {k: [] for k in cases}
    kept = {}
    for r in range(args.repeats):
        order = list(cases)[r % 3 :] + list(cases)[: r % 3]
        for name in order:
            secs, stats, overlap = run(*cases[name])
            seconds[name].append(secs)
            kept[name] = (stats, overlap)
    one, two = kept["trans"][0][0].transitions, kept["trans2"][0][0].transitions
    assert torch.equal(two.counts_LEE, 2 * one.counts_LEE) and torch.equal(two.steps_L, 2 * one.steps_L)
    moe_layers = [m.layer_index for m in layers[0]]
    info = {"base": "b", "post": "p", "data": "d", "rows": len(examples), "moe_layers": moe_layers,
            "num_experts": args.experts, "top_k": args.top_k}  # fmt: skip
    started = time.perf_counter()
    build_report(info, *kept["trans"], seed=0, resolution=1.0)
    report_seconds = time.perf_counter() - started
    med = {k: statistics.median(v) for k, v in seconds.items()}
    out = {
        "tokens_1x": sum(len(e) for e in examples),
        "median_seconds": {k: round(v, 4) for k, v in med.items()},
        "ratio_2x": round(med["trans2"] / med["trans"], 3),
        "ratio_2x_target": None if args.smoke else [1.8, 2.3],
        "ratio_transitions": round(med["trans"] / med["plain"], 3),
        "ratio_transitions_target": None if args.smoke else 1.3,
        "report_seconds": round(report_seconds, 3),
        "repeats": args.repeats,
        "threads": torch.get_num_threads(),
    }
    out |= {"smoke": True} if args.smoke else {}  # a smoke run's figures are no measurement
    print(f"median seconds: {out['median_seconds']}; 2x/1x with transitions {out['ratio_2x']}, "
          f"with/without {out['ratio_transitions']}")  # fmt: skip
    print(json.dumps(out))


if __name__ == "__main__":
    main()
