"""Peak memory of ``rpb collect`` at 1x and 10x rows: it must not grow with the row count.

The prior is ``rows x 2 spans x MoE layers x experts`` float32 values, so this benchmark
makes it large per row: a tiny Qwen3-MoE-shaped model with many MoE layers of many small
experts (default 32 x 256: 64 KiB of prior a row, against a ~27 MB model), over short
synthetic conversations. At 10x rows a collector that held the whole prior in memory would
carry ~180 MiB more than at 1x, far beyond the 10% allowed; ``rpb collect`` writes it to
disk chunk by chunk.

Each run is ``python -m rpb collect`` in a child process; its peak resident set size is the
kernel's ``ru_maxrss`` for that child (``os.wait4``). For contrast, the same rows also go
through a child that keeps the whole prior in memory (``collect_prior`` over every row at
once, then ``save_artifact``: the collector before streaming), unless ``--no-contrast``. The
runs alternate (1x, 10x, and the same in memory) and the medians over ``--repeats`` are
reported: now and then a run's forward passes peak ~100 MiB higher, whatever the row count.
Target: ``ratio`` = peak(10x) / peak(1x) <= 1.1. The last line printed is one JSON object;
the exit status is 0 whether the target holds or not.

``--smoke`` runs each child once on 4 rows (and 40) of a 2-layer, 8-expert model and judges no target: a check
that the script runs, not a measurement.

Run: .venv/bin/python benchmarks/collect_memory.py [--rows 320 --layers 32 --experts 256 ...] [--smoke]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from rpb.testing.data import conversations, write_jsonl
from rpb.testing.models import build_tiny_model
from rpb.testing.tokenizers import moonlight_tokenizer

#: the collector before streaming: every row's prior in one tensor, then one save_file
IN_MEMORY = """
import sys
from rpb.adapters import find_moe_layers
from rpb.prior.artifact import PriorArtifact, save_artifact
from rpb.collect import collect_prior
from rpb.models import load_base_model, load_tokenizer
from rpb.data import load_labelled
model_dir, data, out, batch_size = sys.argv[1], sys.argv[2], sys.argv[3], int(sys.argv[4])
examples = load_labelled(data, load_tokenizer(model_dir), 256).examples
model, facts = load_base_model(model_dir)
prior, counts = collect_prior(model, find_moe_layers(model, facts), examples, batch_size=batch_size, progress=False)
save_artifact(PriorArtifact(prior, counts, counts.new_zeros(len(examples), 32).byte(), {}), out)
"""
#: --smoke: one run of each child on a few rows of a small model (an option given explicitly still wins)
SMOKE = dict(rows=4, layers=2, experts=8, batch_size=4, repeats=1)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--rows", type=int, default=320, help="rows at 1x (10x runs ten times as many)")
    p.add_argument("--layers", type=int, default=32, help="MoE layers")
    p.add_argument("--experts", type=int, default=256, help="routed experts per layer")
    p.add_argument("--batch-size", type=int, default=32)
    p.add_argument("--chunk-rows", type=int, default=256)
    p.add_argument("--threads", type=int, default=1, help="OMP_NUM_THREADS of the children")
    p.add_argument("--repeats", type=int, default=3, help="runs at each size (medians reported)")
    p.add_argument("--no-contrast", action="store_true", help="skip the keep-everything-in-memory runs")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--smoke", action="store_true", help="each child once on a few rows, no target judged")
    args = p.parse_args(argv)
    if args.smoke:  # again, on the smoke defaults: an option given explicitly still wins
        p.set_defaults(**SMOKE)
        args = p.parse_args(argv)
    return args


def peak_rss_mib(cmd: list[str], threads: int) -> tuple[float, float]:
    """(peak RSS in MiB, wall seconds) of ``cmd`` run as a child process."""
    env = {**os.environ, "OMP_NUM_THREADS": str(threads), "TOKENIZERS_PARALLELISM": "false"}
    started = time.perf_counter()
    child = subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    output = child.stdout.read()  # drained while it runs, so a full pipe never stalls it
    _, status, usage = os.wait4(child.pid, 0)
    child.returncode = os.waitstatus_to_exitcode(status)
    if child.returncode != 0:
        sys.exit(f"{' '.join(cmd[:4])} ... failed ({child.returncode}):\n{output.decode(errors='replace')[-3000:]}")
    return usage.ru_maxrss / 1024, time.perf_counter() - started  # ru_maxrss is in KiB on Linux


def build_model(model_dir: Path, args) -> int:
    """Save the many-layer, many-expert model and the tokenizer; return the parameter count."""
    tok = moonlight_tokenizer()
    shape = dict(num_hidden_layers=args.layers, num_experts=args.experts, num_experts_per_tok=2,
                 hidden_size=32, moe_intermediate_size=8, mlp_only_layers=[])  # fmt: skip
    model = build_tiny_model("qwen3_moe", len(tok), args.seed, **shape)
    model.save_pretrained(model_dir)
    tok.save_pretrained(model_dir)
    return sum(p.numel() for p in model.parameters())


def collect_cmd(model_dir: Path, data: Path, out: Path, args) -> list[str]:
    return [sys.executable, "-m", "rpb", "collect", "--model", str(model_dir), "--data-jsonl", str(data),
            "--out-path", str(out), "--top-k", "2", "--max-seq-len", "256", "--batch-size", str(args.batch_size),
            "--chunk-rows", str(args.chunk_rows), "--no-progress"]  # fmt: skip


def in_memory_cmd(model_dir: Path, data: Path, out: Path, args) -> list[str]:
    return [sys.executable, "-c", IN_MEMORY, str(model_dir), str(data), str(out), str(args.batch_size)]


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    if not sys.platform.startswith("linux"):
        raise SystemExit("needs Linux (ru_maxrss in KiB)")
    row_bytes = 2 * args.layers * args.experts * 4
    peaks: dict[int, list[float]] = {1: [], 10: []}
    contrast: dict[int, list[float]] = {1: [], 10: []}
    with tempfile.TemporaryDirectory(prefix="rpb-mem-", ignore_cleanup_errors=True) as tmp:
        tmp = Path(tmp)
        params = build_model(tmp / "model", args)
        print(f"model: qwen3_moe, {args.layers} MoE layers x {args.experts} experts, {params / 1e6:.1f} M parameters")
        print(f"prior: {row_bytes / 1024:.0f} KiB a row; chunks of {args.chunk_rows} rows, batch {args.batch_size}")
        data = {k: write_jsonl(conversations(args.rows * k, args.seed), tmp / f"data-{k}x.jsonl") for k in peaks}
        out = tmp / "prior.safetensors"
        for repeat in range(args.repeats):
            for k in (1, 10):
                rss, wall = peak_rss_mib(collect_cmd(tmp / "model", data[k], out, args), args.threads)
                peaks[k].append(rss)
                out.unlink()
                rows = args.rows * k
                print(f"repeat {repeat + 1}, {k:2d}x: {rows} rows, prior {rows * row_bytes / 2**20:.0f} MiB on disk, "
                      f"peak RSS {rss:.0f} MiB ({wall:.0f} s)")  # fmt: skip
            for k in (1, 10) if not args.no_contrast else ():
                rss, wall = peak_rss_mib(in_memory_cmd(tmp / "model", data[k], out, args), args.threads)
                contrast[k].append(rss)
                out.unlink()
                print(f"repeat {repeat + 1}, {k:2d}x, whole prior in memory: peak RSS {rss:.0f} MiB ({wall:.0f} s)")

    median = {k: statistics.median(v) for k, v in peaks.items()}
    ratio = median[10] / median[1]
    verdict = "--smoke: no target judged" if args.smoke else f"target <= 1.1: {'holds' if ratio <= 1.1 else 'MISSED'}"
    print(f"median peak RSS 10x / 1x: {ratio:.3f}; {verdict}")
    result = {
        "ratio": round(ratio, 4),
        "peak_rss_mib_1x": round(median[1], 1),
        "peak_rss_mib_10x": round(median[10], 1),
    }
    if not args.no_contrast:
        kept = {k: statistics.median(v) for k, v in contrast.items()}
        print(f"whole prior in memory: median 10x / 1x = {kept[10] / kept[1]:.3f} (what the target guards against)")
        result["in_memory_ratio"] = round(kept[10] / kept[1], 4)
        result |= {f"in_memory_peak_rss_mib_{k}x": round(v, 1) for k, v in kept.items()}
    result |= {f"prior_mib_{k}x": round(args.rows * k * row_bytes / 2**20, 1) for k in peaks}
    result |= {"rows_1x": args.rows, "rows_10x": 10 * args.rows, "moe_layers": args.layers, "experts": args.experts}
    result |= {"chunk_rows": args.chunk_rows, "batch_size": args.batch_size, "threads": args.threads}
    result |= {
        "repeats": args.repeats,
        "peak_rss_mib_runs": {f"{k}x": [round(v, 1) for v in p] for k, p in peaks.items()},
    }
    if not args.no_contrast:
        result["in_memory_peak_rss_mib_runs"] = {f"{k}x": [round(v, 1) for v in p] for k, p in contrast.items()}
    result |= {"smoke": True} if args.smoke else {}  # a smoke run's figures are no measurement
    print(json.dumps(result))


if __name__ == "__main__":
    main()
