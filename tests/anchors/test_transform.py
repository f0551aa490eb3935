"""The run's router transform: an explicit setting, else the prior's, else the family's; an override that
differs from the prior's said once, kept."""

from __future__ import annotations

import logging

import pytest

from rpb.adapters import get_adapter
from rpb.anchors.transform import run_transform
from rpb.prior import family_transform

#: the families whose routers score experts with a sigmoid (their vendors' configs: scoring_func /
#: score_function "sigmoid"); every other shipped family scores with a softmax
SIGMOID = {"deepseek_v3", "kimi_k2", "glm4_moe", "minimax_m2"}


@pytest.mark.parametrize(
    "model_type",
    [
        "deepseek_v3",
        "kimi_k2",
        "glm4_moe",
        "minimax_m2",
        "qwen3_moe",
        "mixtral",
        "gpt_oss",
        "olmoe",
        "qwen2_moe",
        "deepseek_v2",
        "qwen3_5_moe",
    ],
)
def test_each_family_gets_its_own_transform_without_a_prior(model_type):
    want = "sigmoid-normalized" if model_type in SIGMOID else "softmax"
    assert family_transform(get_adapter(model_type).score_function) == want
    assert run_transform(None, None, get_adapter(model_type).score_function) == want


def test_the_prior_comes_before_the_family_and_an_override_before_both(caplog):
    with caplog.at_level(logging.WARNING, logger="rpb.anchors"):
        assert run_transform(None, "softmax", "sigmoid") == "softmax"
        assert run_transform("sigmoid-normalized", None, "softmax") == "sigmoid-normalized"
        assert run_transform("softmax", "softmax", "sigmoid") == "softmax"
    assert caplog.records == []  # no prior to differ from, or the same
    with caplog.at_level(logging.WARNING, logger="rpb.anchors"):
        assert run_transform("sigmoid-normalized", "softmax", "sigmoid") == "sigmoid-normalized"
    (said,) = caplog.records
    assert "anchor.router_transform=sigmoid-normalized overrides the prior's transform softmax" in said.getMessage()


@pytest.mark.parametrize("method", ["kl-to-base", "rpb"])
def test_the_toy_worlds_cells_pin_softmax_as_the_shipped_grids_were_made(method, monkeypatch, tmp_path):
    """Its bases are DeepSeek-V3-shaped (sigmoid routers): without the pin a kl-to-base cell (no prior) would
    read the normalised sigmoid, and the shipped kl-to-base cells would not regenerate. The pin is in the
    code, not the cell's recorded anchor, so no shipped cell's identity changes."""
    import rpb.train.run
    from rpb.toyworld.world.post import PostRecipe, train_cell

    seen = []
    monkeypatch.setattr(rpb.train.run, "run_training", lambda cfg, callbacks=(): seen.append(cfg))
    anchor = {"lambda_": 0.1} if method == "kl-to-base" else {"beta": 1.0}
    train_cell(
        tmp_path,
        tmp_path / "d.jsonl",
        tmp_path / "prior",
        tmp_path / "out",
        method,
        42,
        PostRecipe(),
        anchor,
        progress=False,
    )
    (cfg,) = seen
    assert cfg.anchor.router_transform == "softmax" and anchor == (
        {"lambda_": 0.1} if method == "kl-to-base" else {"beta": 1.0}
    )
