"""The toy world's shared runs: the ``rl`` grid in miniature, run once for the tests that read it."""

import pytest
import torch

from tests.toyworld_rl_mini import mini_rl_study


@pytest.fixture(scope="session")
def rl_finished(tmp_path_factory):
    """One miniature ``rl`` study run to the end, at one thread: (the study, its cells' results)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        root = tmp_path_factory.mktemp("rl")
        study = mini_rl_study(root / "base0", root / "cache")
        yield study, study.run()
    finally:
        torch.set_num_threads(threads)


@pytest.fixture(scope="session")
def revert_finished(tmp_path_factory):
    """One miniature ``revert`` study (the ``sft`` and ``kl-to-base`` arms, one seed, checkpoints kept) run to the
    end at one thread: (the study, its cells' results)."""
    from dataclasses import replace
    from pathlib import Path

    from rpb.toyworld.grids.revert import GRID as REVERT_GRID
    from rpb.toyworld.grids.revert import RevertStudy
    from tests.toyworld_mini import MINI_POST
    from tests.toyworld_rl_mini import MINI_RL_RECIPE

    post = replace(MINI_POST, score_parts=("validation", "test"))
    arms = tuple(a for a in REVERT_GRID.arms if a.label in ("sft", "kl-to-base"))
    grid = replace(REVERT_GRID, name="mini-revert", arms=arms, seeds=(42,), bases=(0,), post=post,
                   recipe=MINI_RL_RECIPE)  # fmt: skip
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        root = tmp_path_factory.mktemp("revert")
        study = RevertStudy(Path(root / "base0"), grid, post, Path(root / "cache"), False, keep_checkpoints=True)
        yield study, study.run()
    finally:
        torch.set_num_threads(threads)
