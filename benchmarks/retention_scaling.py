"""Scaling of the ``rpb retention`` routing and statistics passes with the number of tokens.

``rpb retention`` streams the same collated batches through a base and a post model,
reads every router through ``RouterTap`` and accumulates, per MoE layer, utilization
counts (all / Q / A tokens), co-activation counts and the paired top-k overlap. That
pass must cost time linear in the tokens and memory independent of them: the
accumulators are O(layers x experts^2). This benchmark builds two Moonlight-shaped
(DeepSeek-V3) tiny MoEs with the same shape and different seeds ("base" and "post"),
saves them with the Moonlight tokenizer, loads them with ``load_base_model``, labels a
synthetic multi-turn chat file and times ``collect_routing`` on both models:

* 1x: the labelled rows;
* 2x: twice as many rows of the same kind, same batch size. ``--double repeat`` (default)
  runs the 1x rows twice in a row (exactly twice the batches, the same shapes);
  ``--double fresh`` labels a file of 2 x ``--rows`` rows and takes its first half as 1x.

Only the ``collect_routing`` call is timed: model loading, labelling and the Louvain
report (``build_report``) are left out. An untimed warm-up routes every batch once; then
the repeats alternate 1x and 2x (1x first in odd repeats, 2x first in even ones) and the
medians are reported, with the median of the per-repeat ratios as a cross-check that is
less sensitive to slow drifts of the machine. Every timed pass is checked to have counted
each token once per model at every layer. A token is a non-padding position of a row
(collate pads on the right, so a row's tokens are its ``len``); every token is routed once
by each model, so routed tokens = tokens x 2 models, and routed tokens per second =
routed tokens / median seconds. Target: ratio = median(2x) / median(1x) in [1.8, 2.3]
(linear scaling).

Split: the top-k ids the warm-up recorded are fed to the same accumulation calls as in
``collect_routing`` (``ModelRouting.add``, ``PairedOverlap.add``), timed alone (median of
3); the rest of the median is the forward passes and collation.

Memory: the statistics objects (both ``ModelRouting`` and the ``PairedOverlap``) are
measured after a 1x and after a 2x pass, as the bytes of every tensor they hold; they
must be equal and match 8 bytes x models x layers x experts^2 (co-activation counts)
plus O(layers x experts). The per-batch one-hot temporaries (positions x experts float64
for the co-activation product) are bounded by the batch, not by the data, and are
printed as an estimate.

The last line printed is one JSON object; the exit status is 0 whether the target holds or not.

``--smoke`` times one repeat on 2 short rows of two 2-layer, 8-expert models and judges no target: a check that
the script runs, not a measurement.

Run: .venv/bin/python benchmarks/retention_scaling.py [--rows 32 --batch-size 8 --repeats 7 --threads 2 ...]
     [--smoke]
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
from rpb.data import collate, load_labelled
from rpb.models import load_base_model, load_tokenizer
from rpb.observe.trace import RouterTap, route_batch
from rpb.retention.run import collect_routing
from rpb.retention.stats import ModelRouting, PairedOverlap
from rpb.testing.data import long_conversations, write_jsonl
from rpb.testing.models import build_tiny_model
from rpb.testing.tokenizers import moonlight_tokenizer

#: Moonlight's layout at a small width: MLA attention, shared experts, dense first layer.
MLA = dict(kv_lora_rank=64, qk_nope_head_dim=32, qk_rope_head_dim=16, v_head_dim=32)
TARGET = (1.8, 2.3)
POST_SEED_OFFSET = 1000
#: --smoke: one repeat on a few short rows of small models (an option given explicitly still wins)
SMOKE = dict(rows=2, max_seq_len=128, batch_size=2, repeats=1, hidden_size=32, layers=2, experts=8, top_k=2)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--rows", type=int, default=32, help="conversations at 1x")
    p.add_argument("--double", default="repeat", choices=["repeat", "fresh"], help="how 2x is made (see above)")
    p.add_argument("--max-seq-len", type=int, default=512)
    p.add_argument("--batch-size", type=int, default=8)
    p.add_argument("--repeats", type=int, default=7, help="timed passes of each size, after one warm-up")
    p.add_argument("--hidden-size", type=int, default=128)
    p.add_argument("--layers", type=int, default=4, help="decoder layers (the first is dense)")
    p.add_argument("--experts", type=int, default=64, help="routed experts")
    p.add_argument("--top-k", type=int, default=6)
    p.add_argument("--vocab-size", type=int, default=1024)
    p.add_argument("--threads", type=int, default=None, help="torch.set_num_threads (default: as is)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--smoke", action="store_true", help="one repeat on 2 short rows, no target judged")
    args = p.parse_args(argv)
    if args.smoke:  # again, on the smoke defaults: an option given explicitly still wins
        p.set_defaults(**SMOKE)
        args = p.parse_args(argv)
    return args


def write_data(path: Path, rows: int, seed: int) -> None:
    write_jsonl(long_conversations(rows, seed), path)


def shape_of(args) -> dict:
    return {
        **MLA,
        "hidden_size": args.hidden_size,
        "intermediate_size": 2 * args.hidden_size,
        "num_hidden_layers": args.layers,
        "moe_intermediate_size": 64,
        "n_routed_experts": args.experts,
        "num_experts_per_tok": args.top_k,
    }


def build(tmp: Path, args) -> tuple[list[Path], Path]:
    """Both checkpoints (model + tokenizer) and the data file, written under ``tmp``."""
    dirs = [tmp / "base", tmp / "post"]
    for seed, d in zip((args.seed, args.seed + POST_SEED_OFFSET), dirs, strict=True):
        build_tiny_model("moonlight", args.vocab_size, seed, **shape_of(args)).save_pretrained(d)
        moonlight_tokenizer().save_pretrained(d)
    data_path = tmp / "data.jsonl"
    write_data(data_path, args.rows * (2 if args.double == "fresh" else 1), args.seed)
    return dirs, data_path


def time_routing(models, layers, examples, batch_size, pad_id) -> tuple[float, list]:
    started = time.perf_counter()
    stats, overlap = collect_routing(models, layers, examples, batch_size, pad_id, progress=False)
    return time.perf_counter() - started, [*stats, overlap]


def record_routing(models, layers, examples, batch_size, pad_id) -> list:
    """Every batch routed once through every model, as ``collect_routing`` does; per batch, what its statistics read."""
    recorded = []
    taps = [RouterTap(lay) for lay in layers]
    for tap in taps:
        tap.__enter__()
    try:
        for start in range(0, len(examples), batch_size):
            b = collate(examples[start : start + batch_size], pad_id)
            for model in models:
                route_batch(model, b)
            ids = [[tap.topk_ids[pos] for tap in taps] for pos in range(len(layers[0]))]
            recorded.append((ids, b["attention_mask"].reshape(-1).bool(), b["span_ids"].reshape(-1)))
    finally:
        for tap in taps:
            tap.__exit__(None, None, None)
    return recorded


def time_statistics(recorded: list, num_models: int, num_layers: int, num_experts: int) -> float:
    """``collect_routing``'s accumulation loop alone (the same ``add`` calls), on recorded routing."""
    stats = [ModelRouting(num_layers, num_experts) for _ in range(num_models)]
    overlap = PairedOverlap(num_layers, num_experts) if num_models == 2 else None
    started = time.perf_counter()
    for ids_L, valid_T, span_T in recorded:
        for pos, ids in enumerate(ids_L):
            ids = [i.cpu() for i in ids]
            for st, ids_TK in zip(stats, ids, strict=True):
                st.add(pos, ids_TK, valid_T, span_T)
            if overlap is not None:
                overlap.add(pos, ids[0], ids[1], valid_T, span_T)
    return time.perf_counter() - started


def state_bytes(obj, seen: set | None = None) -> int:
    """Bytes of every tensor held by ``obj`` (its attributes, recursively; each storage counted once)."""
    seen = set() if seen is None else seen
    if isinstance(obj, torch.Tensor):
        key = obj.untyped_storage().data_ptr()
        if key in seen:
            return 0
        seen.add(key)
        return obj.untyped_storage().nbytes()
    if isinstance(obj, (list, tuple)):
        return sum(state_bytes(o, seen) for o in obj)
    if isinstance(obj, dict):
        return sum(state_bytes(o, seen) for o in obj.values())
    if hasattr(obj, "__dict__"):
        return sum(state_bytes(o, seen) for o in vars(obj).values())
    return 0


def check_counts(objs: list, tokens: int) -> None:
    """Every model and the overlap saw exactly the non-padding tokens, at every layer."""
    *stats, overlap = objs
    for st in stats:
        if int(st.tokens_S[0]) != tokens or not bool((st.coactivation.tokens_L == tokens).all()):
            raise SystemExit(f"token count mismatch: {int(st.tokens_S[0])} counted, {tokens} expected")
    if not bool((overlap.count_SL[0] == tokens).all()):
        raise SystemExit(f"overlap token count mismatch: {overlap.count_SL[0].tolist()} vs {tokens}")


def mib(n: float) -> str:
    return f"{n / 2**20:.3f} MiB"


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    hf_logging.disable_progress_bar()
    with tempfile.TemporaryDirectory(prefix="rpb-bench-", ignore_cleanup_errors=True) as tmp:
        dirs, data_path = build(Path(tmp), args)
        tokenizer = load_tokenizer(str(dirs[0]))
        examples = load_labelled(data_path, tokenizer, args.max_seq_len).examples
        loaded = [load_base_model(str(d), device="cpu") for d in dirs]
    models = [m for m, _ in loaded]
    layers = [find_moe_layers(m, f) for m, f in loaded]
    pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else 0
    if args.double == "repeat":
        sizes = {"1x": examples, "2x": examples + examples}
    else:
        sizes = {"1x": examples[: args.rows], "2x": examples}
    tokens = {k: sum(len(e) for e in ex) for k, ex in sizes.items()}
    routed = {k: len(models) * t for k, t in tokens.items()}

    c = models[0].config
    num_moe, num_experts = len(layers[0]), int(layers[0][0].router.weight.shape[0])
    params = sum(p.numel() for p in models[0].parameters())
    print(
        f"model: {c.model_type} x2 (base seed {args.seed}, post seed {args.seed + POST_SEED_OFFSET}), "
        f"hidden {c.hidden_size}, {c.num_hidden_layers} layers ({num_moe} MoE, first dense), "
        f"{c.n_routed_experts} experts top-{c.num_experts_per_tok}, {c.n_shared_experts} shared, "
        f"moe_intermediate {c.moe_intermediate_size}, vocab {c.vocab_size}, {params / 1e6:.1f} M params each"
    )
    print(f"runtime: {next(models[0].parameters()).dtype}, attention {c._attn_implementation}, ", end="")
    print(f"experts {getattr(c, '_experts_implementation', None)}, threads {torch.get_num_threads()}")
    for k, ex in sizes.items():
        padded = sum(
            len(ex[s : s + args.batch_size]) * max(len(e) for e in ex[s : s + args.batch_size])
            for s in range(0, len(ex), args.batch_size)
        )
        print(
            f"{k}: {len(ex)} rows, {tokens[k]} tokens (mean {tokens[k] / len(ex):.0f}, max {max(len(e) for e in ex)}), "
            f"{-(-len(ex) // args.batch_size)} batches of {args.batch_size}, {tokens[k] / padded:.0%} of padded "
            f"positions; routed tokens = tokens x {len(models)} models = {routed[k]}"
        )
    print(f"2x made by: {args.double}")

    # warm-up: the forward passes of 1x (and of 2x when it holds other rows), kept for the statistics split
    recorded = {"1x": record_routing(models, layers, sizes["1x"], args.batch_size, pad_id)}
    if args.double == "repeat":
        recorded["2x"] = recorded["1x"] * 2
    else:
        recorded["2x"] = record_routing(models, layers, sizes["2x"], args.batch_size, pad_id)
    seconds: dict[str, list[float]] = {"1x": [], "2x": []}
    memory: dict[str, int] = {}
    for i in range(args.repeats):
        order = ("1x", "2x") if i % 2 == 0 else ("2x", "1x")
        for k in order:
            s, objs = time_routing(models, layers, sizes[k], args.batch_size, pad_id)
            check_counts(objs, tokens[k])  # every token counted once per model, at every layer
            seconds[k].append(s)
            memory[k] = state_bytes(objs)
            del objs
        print(
            f"repeat {i + 1} ({order[0]} first): "
            + ", ".join(f"{k} {seconds[k][-1]:.2f} s ({routed[k] / seconds[k][-1]:,.0f} routed tok/s)" for k in seconds)
            + f", ratio {seconds['2x'][-1] / seconds['1x'][-1]:.3f}"
        )

    med = {k: statistics.median(v) for k, v in seconds.items()}
    tps = {k: routed[k] / med[k] for k in med}
    ratio = med["2x"] / med["1x"]
    paired = statistics.median(b / a for a, b in zip(seconds["1x"], seconds["2x"], strict=True))
    spread = {k: max(v) / min(v) for k, v in seconds.items()}
    token_ratio = tokens["2x"] / tokens["1x"]
    print(
        f"median: 1x {med['1x']:.3f} s ({tps['1x']:,.0f} routed tok/s), "
        f"2x {med['2x']:.3f} s ({tps['2x']:,.0f} routed tok/s); slowest/fastest repeat: "
        + ", ".join(f"{k} {v:.2f}" for k, v in spread.items())
    )
    if max(spread.values()) > 1.25:
        print("note: the repeats of one size differ by more than 25 %: the machine was noisy; rerun or raise --repeats")
    print(f"ratio time(2x)/time(1x) = {ratio:.3f} (tokens x{token_ratio:.3f}), paired median {paired:.3f}; ", end="")
    if args.smoke:
        print("--smoke: no target judged")
    else:
        print(f"target {list(TARGET)}: {'holds' if TARGET[0] <= ratio <= TARGET[1] else 'MISSED'}")

    L, E = num_moe, num_experts
    stats_s = {
        k: statistics.median(time_statistics(r, len(models), L, E) for _ in range(3)) for k, r in recorded.items()
    }
    print(
        "split: "
        + ", ".join(
            f"{k} statistics {stats_s[k]:.3f} s ({stats_s[k] / med[k]:.1%} of the median), "
            f"forward and the rest {med[k] - stats_s[k]:.2f} s"
            for k in stats_s
        )
        + f"; statistics ratio 2x/1x {stats_s['2x'] / stats_s['1x']:.3f}"
    )

    expected = 8 * (len(models) * L * E * E)
    widest = max(
        len(ex[s : s + args.batch_size]) * max(len(e) for e in ex[s : s + args.batch_size])
        for ex in sizes.values()
        for s in range(0, len(ex), args.batch_size)
    )
    print(
        f"statistics state: 1x {mib(memory['1x'])}, 2x {mib(memory['2x'])} "
        f"({'independent of tokens' if memory['1x'] == memory['2x'] else 'GROWS WITH TOKENS'}); "
        f"co-activation counts {len(models)} models x {L} layers x {E}^2 x 8 B = {mib(expected)}, "
        f"the rest {memory['2x'] - expected} B"
    )
    print(f"per-batch temporary (one-hot, float64): <= {widest} positions x {E} x 8 B = {mib(widest * E * 8)}")

    result = {"tokens_1x": tokens["1x"], "tokens_2x": tokens["2x"]}
    result |= {"seconds_1x": round(med["1x"], 4), "seconds_2x": round(med["2x"], 4)}
    result |= {"routed_tokens_per_s": round(tps["1x"], 1), "routed_tokens_per_s_2x": round(tps["2x"], 1)}
    result |= {"ratio": round(ratio, 4), "target": None if args.smoke else list(TARGET)}
    result |= {"paired_ratio": round(paired, 4)}
    result |= {"token_ratio": round(token_ratio, 4)}
    result |= {"stats_seconds_1x": round(stats_s["1x"], 4), "stats_seconds_2x": round(stats_s["2x"], 4)}
    result |= {"stats_bytes_1x": memory["1x"]}
    result |= {"stats_bytes_2x": memory["2x"], "rows_1x": len(sizes["1x"]), "batch_size": args.batch_size}
    result |= {"repeats": args.repeats, "threads": torch.get_num_threads(), "double": args.double}
    result |= {"hidden_size": args.hidden_size, "moe_layers": L, "experts": E, "top_k": args.top_k}
    result |= {"smoke": True} if args.smoke else {}  # a smoke run's figures are no measurement
    print(json.dumps(result))


if __name__ == "__main__":
    main()
