"""The beta rule: the largest candidate before the first that moves more than half the content tokens."""

from __future__ import annotations

import hashlib
from pathlib import Path

from rpb.calibrate import rule


def test_the_rule_on_hand_cases():
    assert rule.recommend_beta({0.25: 0.36, 0.5: 0.6, 1.0: 0.8}) == 0.25
    assert rule.recommend_beta({0.25: 0.55, 0.5: 0.6}) == 0.0  # even the smallest replaces the base
    assert rule.recommend_beta({0.5: 0.2, 1.0: 0.5, 2.0: 0.51}) == 1.0  # at the limit still holds
    assert rule.recommend_beta({0.5: 0.2, 1.0: 0.7, 2.0: 0.4}) == 0.5  # stops at the first exceedance
    assert rule.recommend_beta({0.0: 0.0}) == 0.0


def test_calibrate_json_records_the_rules_own_source():
    described = rule.describe()
    assert described["limit"] == 0.5
    assert described["source_sha256"] == hashlib.sha256(Path(rule.__file__).read_bytes()).hexdigest()
