"""The ``rl`` grid in miniature (seconds): the miniature study's base and scoring, three arms (one weighted, one
replaying), two seeds, a few GRPO steps; shared by the rl grid's tests."""

from dataclasses import replace
from pathlib import Path

from rpb.toyworld.rl import RL_ARMS, RLGrid, RLRecipe
from rpb.toyworld.rl_study import RLStudy
from tests.toyworld_mini import MINI_POST

MINI_RL_RECIPE = RLRecipe(prompts=40, max_steps=4, group_size=2, prompts_per_step=2, steps_per_generation=2,
                          max_completion_length=4)  # fmt: skip
MINI_RL_ARMS = tuple(a for a in RL_ARMS if a.label in ("grpo", "grpo + lbl", "grpo + R3"))
MINI_RL_GRID = RLGrid("mini-rl", ("math_post",), MINI_RL_ARMS, (42, 43), (0,), replace(MINI_POST, score_parts=(
    "validation", "test")), MINI_RL_RECIPE, candidates={"lbl": (0.01, 0.1)})  # fmt: skip


def mini_rl_study(out: Path, cache: Path, grid: RLGrid = MINI_RL_GRID) -> RLStudy:
    return RLStudy(Path(out), grid, grid.post, cache_dir=Path(cache), progress=False)
