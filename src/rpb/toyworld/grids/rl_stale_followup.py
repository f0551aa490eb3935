"""The ``rl-stale`` pilot's follow-up: PR2 below the pilot's smallest scale, judged against R2 on its own runs.

The pilot (``rl_stale.run_pilot``) chose ``pr2_lr_scale`` 50, the bottom of its candidates, and the grid then found
PR2's replayed routes staler than R2's (claim 1 contradicted). This follow-up asks whether a smaller step of the
predictor helps: PR2 at scales 5, 10 and 20 (and 50 again, for the figures the pilot did not log) on the pilot's
base, seed and pressure. Each run logs, beside ``routing/stale_mismatch`` (the live choice against PR2's own
replayed routes), ``routing/stale_mismatch_r2`` (against the routes R2 would have replayed on the same trajectory:
the batch's first-forward routes) and ``pr2/changed_share`` (the share of the first forward's expert sets the
predictor changed, at update 0). The grid's verdict stands whatever this shows: a pilot, one base and one seed.

Run: ``python -m rpb.toyworld.grids.rl_stale_followup OUT`` (resumable run by run; each run's figures in
``OUT/<run>.json``), then ``followup.md`` is written from those files alone, as its test regenerates it.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

from rpb.toyworld.grids.rl_stale import PILOT, PILOT_BASE, PILOT_SEED, STUDY_POST, _grid
from rpb.toyworld.study.rl import RLStudy
from rpb.toyworld.world.rl import RLArm, RLRecipe

#: the scales tried, the pilot's chosen 50 last
SCALES = (5.0, 10.0, 20.0, 50.0)
#: each run's summary figures the report reads, with their headings
FIGURES = (
    ("stale_mismatch", "stale vs PR2's replayed routes"),
    ("stale_mismatch_r2", "stale vs R2's routes (same run)"),
    ("pr2_changed_share", "sets the predictor changed (update 0)"),
)


def run_followup(out: Path, cache_dir: Path | None = None) -> str:
    """Every scale's run (finished ones read back), then the report; returns it."""
    import dataclasses

    from rpb.fileio import write_json_atomic
    from rpb.toyworld.world.rl import train_rl_cell

    out = Path(out)
    grid = dataclasses.replace(_grid(), seeds=(PILOT_SEED,), bases=(PILOT_BASE,))
    study = RLStudy(out / "study", grid, STUDY_POST, cache_dir=cache_dir, progress=False, base_seed=PILOT_BASE)
    updates, iterations, lr = PILOT["pressure"]
    for scale in SCALES:
        path = out / f"pr2-{scale:g}.json"
        if path.is_file():
            continue
        arm = RLArm("grpo + PR2", replay="PR2", trl=(("num_iterations", iterations), ("pr2_lr_scale", scale)))
        recipe = RLRecipe(steps_per_generation=updates, lr=lr)
        record = train_rl_cell(study.start(), study.prompts(), study.tasks(), out / path.stem, arm, PILOT_SEED, recipe)
        write_json_atomic(path, {"summary": record["summary"], "settings": record["settings"], "scale": scale})
    return write_report(out)


def _against_r2(run: dict) -> float:
    """PR2's stale mismatch minus R2's on the same run (below 0: PR2's replayed routes are the less stale)."""
    return run["summary"]["stale_mismatch"] - run["summary"]["stale_mismatch_r2"]


def write_report(out: Path) -> str:
    """``followup.md`` from the runs' files in ``out`` (every scale's, in ``SCALES`` order)."""
    from rpb.fileio import write_text_atomic

    runs = [json.loads((Path(out) / f"pr2-{scale:g}.json").read_text()) for scale in SCALES]
    updates, iterations, lr = PILOT["pressure"]
    lines = [
        "# The `rl-stale` pilot's follow-up: PR2 below scale 50, against R2 on its own runs",
        "",
        f"PR2 on base {PILOT_BASE}'s start, seed {PILOT_SEED}, {updates} updates x {iterations} iterations per "
        f"generation batch, learning rate {lr:g} (the pilot's pressure); means over the training's logged steps "
        "(rpb/toyworld/grids/rl_stale_followup.py). One base, one seed: a pilot, not a verdict.",
        "",
        "| pr2_lr_scale | " + " | ".join(label for _, label in FIGURES) + " | PR2 − R2 |",
        "|---" * (len(FIGURES) + 2) + "|",
    ]
    for run in runs:
        s = run["summary"]
        cells = [f"{s[key]:.4f}" for key, _ in FIGURES] + [f"{_against_r2(run):+.4f}"]
        lines.append(f"| {run['scale']:g} | " + " | ".join(cells) + " |")
    best = min(runs, key=_against_r2)
    lines += [
        "",
        f"Least stale against R2's routes on the same run: scale {best['scale']:g} "
        f"({_against_r2(best):+.4f}). "
        + (
            "PR2's replayed routes are staler than R2's would have been at every scale tried."
            if all(r["summary"]["stale_mismatch"] > r["summary"]["stale_mismatch_r2"] for r in runs)
            else "At some scale PR2's replayed routes are less stale than R2's would have been."
        ),
        "",
    ]
    text = "\n".join(lines)
    write_text_atomic(Path(out) / "followup.md", text)
    return text


if __name__ == "__main__":
    print(run_followup(Path(sys.argv[1])))
