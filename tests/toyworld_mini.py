"""A miniature toy-world study (seconds, not hours), shared by the tests and their killed subprocess.

``python -m tests.toyworld_mini OUT CACHE [mini|mini-cot]`` runs it to the end (or until killed).
"""

import os
import signal
import subprocess
import sys
import time
from dataclasses import replace
from pathlib import Path

from rpb.toyworld.grids.cot import COT_TABLE
from rpb.toyworld.grids.demo import DEMO_TABLE
from rpb.toyworld.study.cells import Study
from rpb.toyworld.study.grid import Arm, Grid
from rpb.toyworld.world.base import BaseRecipe
from rpb.toyworld.world.post import PostRecipe

MINI_BASE = BaseRecipe(hidden_size=32, num_hidden_layers=2, n_routed_experts=8, num_experts_per_tok=2,
                       moe_intermediate_size=16, intermediate_size=64, batch_size=8, max_steps=6, pool=64)  # fmt: skip
MINI_POST = PostRecipe(train_rows=48, max_steps=3, batch_size=8, warmup_steps=0, eval_id=4, eval_ood=4, probe_rows=24,
                       base=MINI_BASE)  # fmt: skip
#: two methods, one seed; lbl's weight chosen on validation from two candidates
MINI_GRID = Grid("mini", ("math_post",), (Arm("lbl", "lbl"), Arm("rpb", "rpb")), (42,), tables=("demo",),
                 candidates={"lbl": (0.01, 0.1)}, table_kinds={"demo": DEMO_TABLE})  # fmt: skip


#: the long-trace grid in miniature: the trace set, sft and a within-transition control, one seed
MINI_COT_GRID = Grid("mini-cot", ("sum_trace",),
                     (Arm("sft", "sft"), Arm("within-transition-soft", "within-transition-soft")), (42,),
                     tables=("cot",), table_kinds={"cot": COT_TABLE})  # fmt: skip
MINI_COT_POST = replace(MINI_POST, max_seq_len=128, probe_rows=12)
GRIDS = {"mini": (MINI_GRID, MINI_POST), "mini-cot": (MINI_COT_GRID, MINI_COT_POST)}


def mini_study(out, cache, grid: str = "mini") -> Study:
    return Study(Path(out), *GRIDS[grid], cache_dir=Path(cache), progress=False)


def kill_after_first_cell(out: Path, cache: Path, grid: str = "mini") -> int:
    """Run the miniature study in a subprocess and SIGKILL it right after its first finished cell; the number
    of cells it had finished (the kill can land after a second one, never after the tables)."""
    root = Path(__file__).resolve().parents[1]
    env = {**os.environ, "PYTHONPATH": str(root)}
    proc = subprocess.Popen([sys.executable, "-m", "tests.toyworld_mini", str(out), str(cache), grid], cwd=root,
                            env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)  # fmt: skip
    deadline = time.monotonic() + 240
    while not list(out.glob("**/result.json")):
        assert proc.poll() is None and time.monotonic() < deadline, "the study ended before it could be killed"
        time.sleep(0.02)
    proc.send_signal(signal.SIGKILL)
    assert proc.wait() == -signal.SIGKILL
    assert not (out / "tables.md").exists()
    return len(list(out.glob("**/result.json")))


if __name__ == "__main__":
    study = mini_study(*sys.argv[1:4])
    study.report(study.run())
