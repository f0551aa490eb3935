"""The embedded default run (``rpb demo``, the README's main command): the paper's study in miniature.

base model (cached, or pretrained in about 10 minutes on 2 CPU cores) -> post-training data
(the math set) -> routing prior -> ``sft``, ``lbl``, ``rpb`` and ``rpb`` at the beta ``rpb calibrate``
recommends, post-trained -> a table of
ID / OOD exact match and routing retention (TVD, top-k overlap, NMI), with plots.
Everything is built locally; nothing is downloaded.
"""

from __future__ import annotations

import time
from pathlib import Path

from rpb.toyworld.experiment import GRIDS, Study
from rpb.toyworld.world import PostRecipe, base_dir


def run_demo(out_dir: str | Path = "rpb-demo", cache_dir: str | Path | None = None, progress: bool = True) -> int:
    started = time.perf_counter()
    grid = GRIDS["demo"]
    study = Study(Path(out_dir), grid, grid.post or PostRecipe(), Path(cache_dir) if cache_dir else None, progress,
                  keep_checkpoints=True)  # fmt: skip
    where = base_dir(study.post.base, study.cache_dir)
    cached = (where / "recipe.json").is_file()
    print(f"[1/4] base model: {'cached' if cached else 'pretraining (about 9 minutes on 2 CPU cores)'} in {where}")
    study.base()
    study.pin()
    post_set = study.grid.sets[0]
    print(f"[2/4] routing prior of the base over {study.post.train_rows} {post_set} training conversations")
    study.prior(post_set)
    print(f"[3/4] post-training {', '.join(a.label for a in study.grid.arms)} on {post_set}, then scoring")
    results = study.run()
    print("[4/4] tables and plots")
    tables = study.report(results)
    print()
    print(tables)
    print(f"written: {study.out / 'tables.md'}, tradeoff.png, retention.png; per-run retention reports in "
          f"{study.out / 'runs'}; {time.perf_counter() - started:.0f} s in all")  # fmt: skip
    return 0
