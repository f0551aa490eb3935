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
