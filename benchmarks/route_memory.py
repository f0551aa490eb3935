"""Peak anonymous memory of training from stored routes, with route files of 1x and >= 10x bytes per token: it must
not grow with the file.

The same rows, model and steps (``rpb train``, ``routing-kd`` from stored routes, the bucket form), twice: once with
a route file holding each token's top-k with probabilities (``rpb routes --with-probs``: ``--top-m k``), once with
the whole distribution (``--top-m E``), E / k times the bytes per token. A tiny Moonlight-shaped model with a wide
router (default 512 experts, top-2: 256x the bytes) over enough rows that the large file is far bigger than what a
training step holds. A trainer that held the file whole would carry its size in its own memory; ``rpb`` reads a
batch's rows from a read-only map of the file, which the kernel counts in the page cache, not in the process.

Each run is a child process; a thread in it reads ``RssAnon`` from ``/proc/self/status`` every 2 ms (the anonymous
resident memory: ``ru_maxrss`` would count the map's resident pages too) and reports the peak. The runs alternate
(small, large) ``--repeats`` times; the medians are reported. Target: ``ratio`` = peak(large) / peak(small) <= 1.1.
The last line printed is one JSON object; the exit status is 0 whether the target holds or not.

``--smoke`` runs each child once on 4 rows of an 8-expert model and judges no target: a check that the script runs.

Run: .venv/bin/python benchmarks/route_memory.py [--rows 160 --experts 512 --steps 4 --repeats 3] [--smoke]
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

#: the child: rpb train from the route file, its peak RssAnon sampled by a thread
CHILD = """
import json, sys, threading, time
def rss_anon():
    return next(int(l.split()[1]) * 1024 for l in open("/proc/self/status") if l.startswith("RssAnon:"))
peak = [rss_anon()]
def poll():
    while True:
        peak[0] = max(peak[0], rss_anon())
        time.sleep(0.002)
threading.Thread(target=poll, daemon=True).start()
from rpb.train.config import load_config
from rpb.train.run import run_training
folder, routes, steps = sys.argv[1], sys.argv[2], sys.argv[3]
cfg = load_config(None, [f"model={folder}/model", f"data_jsonl={folder}/train.jsonl", f"output_dir={routes}.run",
    "anchor.method=routing-kd", "anchor.lambda=1.0", "anchor.router_transform=softmax", "anchor.base=routes",
    f"anchor.routes={routes}", f"train.max_steps={steps}", "train.batch_size=4", "train.lr=1e-3",
    "train.max_seq_len=192", "train.calibrate_rows=0", "train.log_every=1"])
run_training(cfg, progress=False)
time.sleep(0.02)
print(json.dumps({"peak_rss_anon": peak[0]}))
"""
#: --smoke: one run of each child on a few rows of a small model (an option given explicitly still wins)
SMOKE = dict(rows=4, experts=8, steps=1, repeats=1)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--rows", type=int, default=160, help="training rows (the large file grows with them)")
    p.add_argument("--experts", type=int, default=512, help="routed experts of the tiny model (top-2)")
    p.add_argument("--steps", type=int, default=4)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--smoke", action="store_true", help="one run each at a tiny shape; no target judged")
    a = p.parse_args(argv)
    if a.smoke:
        given = {k for k in SMOKE if any(arg.startswith(f"--{k}") for arg in (argv or sys.argv[1:]))}
        for k, v in SMOKE.items():
            if k not in given:
                setattr(a, k, v)
    return a


def make(folder: Path, rows: int, experts: int) -> tuple[Path, Path]:
    """The model, the rows and the two route files (top-k with probabilities; every expert)."""
    from rpb.collect.hf_routes import write_routes
    from rpb.testing.data import conversations, write_jsonl
    from rpb.testing.models import build_tiny_model
    from rpb.testing.tokenizers import moonlight_tokenizer

    tok = moonlight_tokenizer()
    build_tiny_model("moonlight", vocab_size=len(tok), n_routed_experts=experts).save_pretrained(folder / "model")
    tok.save_pretrained(folder / "model")
    data = write_jsonl(conversations(rows, seed=5), folder / "train.jsonl")
    small, large = folder / "topk.safetensors", folder / "whole.safetensors"
    write_routes(str(folder / "model"), data, small, 192, batch_size=32, probs_transform="softmax")
    write_routes(str(folder / "model"), data, large, 192, batch_size=32, probs_transform="softmax", top_m=experts)
    return small, large


def peak(folder: Path, routes: Path, steps: int) -> int:
    out = subprocess.run(
        [sys.executable, "-c", CHILD, str(folder), str(routes), str(steps)],
        check=True,
        capture_output=True,
        text=True,
        env={"OMP_NUM_THREADS": "1", "PATH": "/usr/bin:/bin", "HF_HUB_OFFLINE": "1"},
    )
    return json.loads(out.stdout.strip().splitlines()[-1])["peak_rss_anon"]


def main(argv: list[str] | None = None) -> None:
    a = parse_args(argv)
    folder = Path(tempfile.mkdtemp(prefix="route-memory-"))
    small, large = make(folder, a.rows, a.experts)
    peaks: dict[str, list[int]] = {"small": [], "large": []}
    for _ in range(a.repeats):
        for name, path in (("small", small), ("large", large)):
            peaks[name].append(peak(folder, path, a.steps))
    median = {k: statistics.median(v) for k, v in peaks.items()}
    ratio = median["large"] / median["small"]
    sizes = {"small": small.stat().st_size, "large": large.stat().st_size}
    print(f"route files: {sizes['small'] / 2**20:.1f} MiB (top-k with probabilities) and "
          f"{sizes['large'] / 2**20:.1f} MiB (every expert), {sizes['large'] / sizes['small']:.1f}x")  # fmt: skip
    print(f"peak RssAnon: {median['small'] / 2**20:.1f} MiB and {median['large'] / 2**20:.1f} MiB, ratio {ratio:.3f}")
    figures = {
        "ratio": round(ratio, 4),
        "file_bytes": sizes,
        "file_ratio": round(sizes["large"] / sizes["small"], 2),
        "peak_rss_anon": peaks,
        "rows": a.rows,
        "experts": a.experts,
        "steps": a.steps,
    }
    if a.smoke:
        figures["smoke"] = True
    else:
        figures["target"] = "ratio <= 1.1"
        figures["holds"] = ratio <= 1.1
    print(json.dumps(figures))


if __name__ == "__main__":
    main()
