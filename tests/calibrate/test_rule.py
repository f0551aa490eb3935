"""The beta rule: the largest candidate before the first that moves more than half the content tokens."""

from __future__ import annotations

import hashlib
import importlib.util
from pathlib import Path

import pytest

from rpb.calibrate import rule

# The sha256 of src/rpb/calibrate/rule.py as committed before the toy world's bases 1 and 2 existed
# (the shipped calibrate.json files record the same value; tests/project/test_shipped_results.py checks
# them against the file). The rule was fixed before the study's data: if you edit rule.py, this test
# must fail. Update the literal only on purpose, and say in the commit why the rule changed.
COMMITTED_RULE_SHA256 = "bfedbf0c309482717558b685023c41e32cda45107a68f852d780bd4433757c29"


def test_the_rule_on_hand_cases():
    assert rule.recommend_beta({0.25: 0.36, 0.5: 0.6, 1.0: 0.8}) == 0.25
    assert rule.recommend_beta({0.25: 0.55, 0.5: 0.6}) == 0.0  # even the smallest replaces the base
    assert rule.recommend_beta({0.5: 0.2, 1.0: 0.5, 2.0: 0.51}) == 1.0  # at the limit still holds
    assert rule.recommend_beta({0.5: 0.2, 1.0: 0.7, 2.0: 0.4}) == 0.5  # stops at the first exceedance
    assert rule.recommend_beta({0.0: 0.0}) == 0.0


def check_rule_is_the_committed_one() -> None:
    """The rule's source is the committed one, and calibrate.json would record that source's hash."""
    described = rule.describe()
    assert described["limit"] == 0.5
    assert hashlib.sha256(Path(rule.__file__).read_bytes()).hexdigest() == COMMITTED_RULE_SHA256
    assert described["source_sha256"] == COMMITTED_RULE_SHA256


def test_calibrate_json_records_the_rules_own_source():
    check_rule_is_the_committed_one()


def test_mutant_edited_rule_is_caught(tmp_path, monkeypatch):
    """A one-character edit of rule.py (the limit 0.5 -> 0.50, same behaviour) still shows: the edited
    file, imported, stands in for the module."""
    source = Path(rule.__file__).read_text()
    assert "DISPLACEMENT_LIMIT = 0.5\n" in source
    edited = tmp_path / "rule.py"
    edited.write_text(source.replace("DISPLACEMENT_LIMIT = 0.5\n", "DISPLACEMENT_LIMIT = 0.50\n"))
    spec = importlib.util.spec_from_file_location("edited_rule", edited)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    assert module.describe()["limit"] == 0.5  # only the hash can tell it apart
    monkeypatch.setattr(rule, "__file__", str(edited))
    monkeypatch.setattr(rule, "RULE_SHA256", module.RULE_SHA256)
    with pytest.raises(AssertionError):
        check_rule_is_the_committed_one()
