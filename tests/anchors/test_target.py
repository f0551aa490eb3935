"""The target controller against a hand simulation of its documented rule: the start guard, the clipped error
normalised by the drift the target allows, the quiet learning rate, the clamp and the one warning, and its state
carried whole through a checkpoint."""

from __future__ import annotations

import logging
import math

import pytest

from rpb.anchors.target import TargetController, TargetSettings


def test_a_known_measure_sequence_gives_the_documented_lambdas():
    ctl = TargetController(TargetSettings(target=0.8))  # λ0 1, rate 0.1, clip 1; the drift allowed: 0.2
    got = [ctl.update(m) for m in (1.0, 0.95, 0.9, 0.78, 0.7, 0.85, 0.8, 1.0, 0.2)]
    # by hand: held at 1 until 0.78 < 0.8; then log λ += 0.1 x e, e = (0.8 - m) / 0.2 clipped to [-1, 1]
    logs = [0.0, 0.0, 0.0, 0.01, 0.01 + 0.05, 0.06 - 0.025, 0.035, 0.035 - 0.1, -0.065 + 0.1]
    assert got == pytest.approx([math.exp(x) for x in logs], rel=1e-12)
    assert ctl.armed and ctl.steps == 9


def test_before_the_routing_moves_lambda_is_held_and_at_learning_rate_zero_it_settles_there():
    ctl = TargetController(TargetSettings(target=0.9, lambda_0=3.0))
    assert [ctl.update(1.0, lr=0.0, peak_lr=1e-3) for _ in range(50)] == [3.0] * 50  # m = 1: no decay, no windup
    assert not ctl.armed


def test_a_quiet_learning_rate_raises_nothing_but_may_lower():
    ctl = TargetController(TargetSettings(target=0.8))
    ctl.update(0.5)  # armed; e = 1.5 clipped to 1
    assert ctl.lam == pytest.approx(math.exp(0.1))
    assert ctl.update(0.5, lr=0.04, peak_lr=1.0) == pytest.approx(math.exp(0.1))  # below 5% of the peak: held
    assert ctl.update(1.0, lr=0.04, peak_lr=1.0) == pytest.approx(1.0)  # lowering is allowed
    assert ctl.update(0.5, lr=0.05, peak_lr=1.0) == pytest.approx(math.exp(0.1))  # at 5%: raised again


def test_lambda_is_clamped_and_an_unreachable_target_warns_once(caplog):
    ctl = TargetController(TargetSettings(target=0.9, lambda_max=2.0, rate=1.0, patience_steps=3))
    with caplog.at_level(logging.WARNING, logger="rpb.anchors.target"):
        got = [ctl.update(0.0) for _ in range(8)]
    assert got == [2.0] * 8  # e^1 at the first step, clamped to λ_max
    warnings = [r.getMessage() for r in caplog.records]
    assert len(warnings) == 1 and "anchor.target=0.9 looks unreachable" in warnings[0]


def test_the_state_resumes_the_same_sequence_and_refuses_other_settings():
    ms = (1.0, 0.7, 0.75, 0.9, 0.6, 0.95)
    whole = TargetController(TargetSettings(target=0.8))
    expected = [whole.update(m) for m in ms]
    first = TargetController(TargetSettings(target=0.8))
    got = [first.update(m) for m in ms[:3]]
    resumed = TargetController(TargetSettings(target=0.8))
    resumed.load_state_dict(first.state_dict())
    assert got + [resumed.update(m) for m in ms[3:]] == expected
    with pytest.raises(ValueError, match="controller ran with"):
        TargetController(TargetSettings(target=0.7)).load_state_dict(first.state_dict())


def test_settings_outside_their_range_are_named():
    assert TargetSettings(target=1.2).problems() == ["anchor.target: the overlap to hold, in (0, 1], got 1.2"]
    assert TargetSettings(target=0.8, lambda_0=5e3).problems()[0].startswith("anchor.target: need 0 < lambda_min")
    assert TargetSettings(target=0.8).problems() == []
