"""The embedded default run (``rpb demo``, the README's main command): the paper's study in miniature.

base model (cached, the repository's shipped base 0, or pretrained here: ``--from-scratch``) -> post-training data
(the math set) -> routing prior -> ``sft``, ``lbl``, ``rpb`` and ``rpb`` at the beta ``rpb calibrate``
recommends, post-trained -> a table of
ID / OOD exact match and routing retention (TVD, top-k overlap, NMI), with plots.
Everything is built locally; nothing is downloaded.
"""

from __future__ import annotations

import json
import time
from pathlib import Path

from rpb.toyworld.grids.demo import GRID
from rpb.toyworld.study.cells import Study
from rpb.toyworld.study.lanes import default_lanes, lane_threads
from rpb.toyworld.world.post import PostRecipe, base_dir, shipped_base


def run_demo(
    out_dir: str | Path = "rpb-demo",
    cache_dir: str | Path | None = None,
    progress: bool = True,
    from_scratch: bool = False,
    lanes: int | None = None,
) -> int:
    """``lanes``: processes side by side (rpb.toyworld.study.lanes; default one per usable core)."""
    started = time.perf_counter()
    grid = GRID
    lanes = lanes or default_lanes()
    study = Study(
        Path(out_dir),
        grid,
        grid.post or PostRecipe(),
        Path(cache_dir) if cache_dir else None,
        progress,
        keep_checkpoints=True,
        shipped=not from_scratch,
        lanes=lanes,
    )
    where = base_dir(study.post.base, study.cache_dir)
    record = json.loads((where / "recipe.json").read_text()) if (where / "recipe.json").is_file() else None
    shipped = None if from_scratch else shipped_base(study.post.base)
    if record is not None and (shipped is not None or "shipped" not in record):
        how = f"cached in {where}" + (f" (a copy of the shipped {record['shipped']})" if "shipped" in record else "")
    elif shipped is not None:
        pin = json.loads((shipped.parent / "bases.json").read_text())[shipped.name]
        threads = f"{pin['threads']} thread" + ("s" if pin["threads"] != 1 else "")
        how = f"the shipped {shipped} (built on {pin['machine']}, {threads}; --from-scratch pretrains it here instead)"
    else:
        how = f"pretraining (about 10 minutes on 2 CPU cores) into {where}"
    print(f"[1/4] base model: {how}")
    study.base()
    study.pin()
    post_set = study.grid.sets[0]
    print(f"[2/4] routing prior of the base over {study.post.train_rows} {post_set} training conversations")
    study.prior(post_set)
    side = f"{lanes} processes side by side, {lane_threads(lanes)} thread(s) each" if lanes > 1 else "one process"
    print(f"[3/4] post-training {', '.join(a.label for a in study.grid.arms)} on {post_set}, then scoring ({side})")
    results = study.run()
    print("[4/4] tables and plots")
    tables = study.report(results)
    print()
    print(tables)
    print(
        f"written: {study.out / 'tables.md'}, tradeoff.png, retention.png; per-run retention reports in "
        f"{study.out / 'runs'}; {time.perf_counter() - started:.0f} s in all"
    )
    return 0
