"""The ``rl`` grid in miniature (seconds): the miniature study's base and scoring, three arms (one weighted, one
replaying), two seeds, a few GRPO steps; shared by the rl grid's tests."""

from dataclasses import replace
from pathlib import Path

from rpb.toyworld.grids.rl import GRID as RL_GRID
from rpb.toyworld.grids.rl import RL_ARMS
from rpb.toyworld.study.rl import RLGrid, RLStudy
from rpb.toyworld.world.rl import RLRecipe
from tests.toyworld_mini import MINI_POST

MINI_RL_RECIPE = RLRecipe(prompts=40, max_steps=4, group_size=2, prompts_per_step=2, steps_per_generation=2,
                          max_completion_length=4)  # fmt: skip
MINI_RL_ARMS = tuple(a for a in RL_ARMS if a.label in ("grpo", "grpo + lbl", "grpo + R3"))
#: the rl grid's claims, pairs and collapse rule, on the miniature's arms, seeds, base and recipe
MINI_RL_GRID = replace(RL_GRID, name="mini-rl", arms=MINI_RL_ARMS, seeds=(42, 43), bases=(0,), post=replace(
    MINI_POST, score_parts=("validation", "test")), recipe=MINI_RL_RECIPE, candidates={"lbl": (0.01, 0.1)})  # fmt: skip


def mini_rl_study(out: Path, cache: Path, grid: RLGrid = MINI_RL_GRID) -> RLStudy:
    return RLStudy(Path(out), grid, grid.post, cache_dir=Path(cache), progress=False)
