"""Throughput of ``rpb routes`` in shards against a plain forward over the same rows: it must keep >= 0.9 of it.

The toy world's shipped base 0 (Moonlight-shaped: 4 layers, 64 experts, top-6) over its math_post rows, both sides
in this process, alternating, medians of ``--repeats``:

* ``routes``: ``rpb routes --with-probs --chunk-rows N`` (``rpb.collect.hf_routes.write_route_shards``): the rows
  labelled chunk by chunk, the base loaded, each batch's forward under the route recorder, every shard's routes and
  probabilities saved, the index written;
* ``plain``: the same rows labelled, the same base loaded, the same batches (``plan_batches``) forwarded under
  ``inference_mode`` with nothing recorded or saved.

``ratio`` = plain seconds / routes seconds (the routes' throughput as a share of the plain forward's). Target:
>= 0.9. The last line printed is one JSON object; the exit status is 0 whether the target holds or not.

``--smoke`` runs each side once on 16 rows and judges no target: a check that the script runs.

Run: .venv/bin/python benchmarks/routes_throughput.py [--rows 2048 --chunk-rows 256 --repeats 3 --threads 2]
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

BASE = Path(__file__).resolve().parents[1] / "bases" / "base0"
MAX_LEN = 96
#: --smoke: one run of each side on a few rows (an option given explicitly still wins)
SMOKE = dict(rows=16, chunk_rows=8, repeats=1)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--rows", type=int, default=2048)
    p.add_argument("--chunk-rows", type=int, default=256)
    p.add_argument("--batch-size", type=int, default=32)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--smoke", action="store_true", help="one run each on a few rows; no target judged")
    a = p.parse_args(argv)
    if a.smoke:
        given = {k for k in SMOKE if any(x.startswith(f"--{k.replace('_', '-')}") for x in (argv or sys.argv[1:]))}
        for k, v in SMOKE.items():
            if k not in given:
                setattr(a, k, v)
    return a


def plain(data: Path, batch_size: int) -> float:
    """Seconds to label the rows, load the base and forward every batch, recording nothing."""
    from rpb.collect.collector import plan_batches
    from rpb.collect.rows import KEEP_TOKENS, label_range, scan_rows
    from rpb.data import ChatTemplate
    from rpb.models import load_base_model, load_tokenizer, pad_id_of

    start = time.perf_counter()
    template = ChatTemplate(load_tokenizer(str(BASE)), None)
    rows = scan_rows(data, template, MAX_LEN, KEEP_TOKENS)
    examples = label_range(rows, template, MAX_LEN, 0, rows.num_rows)
    model, _ = load_base_model(str(BASE), "float32", None, "cpu")
    pad = pad_id_of(template.tokenizer)
    with torch.inference_mode():
        for positions in plan_batches([len(e) for e in examples], batch_size):
            P = max(len(examples[i]) for i in positions)
            ids = torch.full((len(positions), P), pad, dtype=torch.long)
            mask = torch.zeros((len(positions), P), dtype=torch.long)
            for b, i in enumerate(positions):
                ids[b, : len(examples[i])] = torch.tensor(examples[i].input_ids)
                mask[b, : len(examples[i])] = 1
            model(input_ids=ids, attention_mask=mask, use_cache=False)
    return time.perf_counter() - start


def routes(data: Path, out: Path, chunk_rows: int, batch_size: int) -> float:
    """Seconds of ``rpb routes --with-probs --chunk-rows`` over the rows, from nothing done."""
    import shutil

    from rpb.collect.hf_routes import write_route_shards

    shutil.rmtree(out, ignore_errors=True)
    start = time.perf_counter()
    write_route_shards(str(BASE), data, out, MAX_LEN, chunk_rows, batch_size=batch_size,
                       probs_transform="family", device="cpu")  # fmt: skip
    return time.perf_counter() - start


def main(argv: list[str] | None = None) -> None:
    from rpb.toyworld.world.post import write_rows
    from rpb.toyworld.world.tasks import sample

    a = parse_args(argv)
    torch.set_num_threads(a.threads)
    tmp = Path(tempfile.mkdtemp(prefix="routes-throughput-"))
    data = write_rows(sample("math_post", a.rows, seed=0), tmp / "math_post.jsonl")
    times: dict[str, list[float]] = {"plain": [], "routes": []}
    for _ in range(a.repeats):
        times["plain"].append(plain(data, a.batch_size))
        times["routes"].append(routes(data, tmp / "routes", a.chunk_rows, a.batch_size))
    median = {k: statistics.median(v) for k, v in times.items()}
    ratio = median["plain"] / median["routes"]
    print(f"{a.rows} rows: plain forward {median['plain']:.2f} s, rpb routes in shards {median['routes']:.2f} s, "
          f"throughput ratio {ratio:.3f}")  # fmt: skip
    figures = {"ratio": round(ratio, 4), "seconds": times, "rows": a.rows, "chunk_rows": a.chunk_rows,
               "batch_size": a.batch_size, "threads": a.threads}  # fmt: skip
    if a.smoke:
        figures["smoke"] = True
    else:
        figures["target"] = "ratio >= 0.9"
        figures["holds"] = ratio >= 0.9
    print(json.dumps(figures))


if __name__ == "__main__":
    main()
