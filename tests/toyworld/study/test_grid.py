"""What a grid is: its arms, and the fields ``grid.json`` pins (every field but how the grid is run and judged)."""

from __future__ import annotations

import dataclasses
import json

from rpb.toyworld.study.grid import Arm, Grid, arms, pinned_fields, table_weights


def test_an_arms_slug_drops_spaces_and_equals_signs():
    assert Arm("rpb beta=0.25", "rpb").slug == "rpbbeta0.25"
    assert Arm("rpb calibrated", "rpb").slug == "rpbcalibrated"
    assert Arm("kl-to-base", "kl-to-base").slug == "kl-to-base"
    assert arms("sft", "lbl") == (Arm("sft", "sft"), Arm("lbl", "lbl"))


def test_the_pin_holds_what_results_depend_on_and_not_how_they_are_reported():
    plain = Grid("g", ("math_post",), arms("sft"), (1,))
    judged = dataclasses.replace(plain, about="x", report=print, claims=len, judges_beta_rule=True,
                                 table_kinds={"t": ("T", ("id",), True)})  # fmt: skip
    assert judged == plain  # how a grid is run and judged is not what it is
    assert pinned_fields(judged) == pinned_fields(plain)
    assert list(pinned_fields(plain)) == [
        "name", "sets", "arms", "seeds", "coefficients", "tables", "candidates", "bases", "post"
    ]  # fmt: skip
    assert json.loads(json.dumps(pinned_fields(plain)))["arms"] == [
        {"label": "sft", "method": "sft", "anchor": [], "calibrated": False}
    ]
    assert pinned_fields(dataclasses.replace(plain, seeds=(2,))) != pinned_fields(plain)


def test_table_weights_keep_only_weighted_methods():
    weights = table_weights()
    assert "sft" not in weights  # no anchor, nothing to weigh
    assert all(isinstance(w, tuple) and w for w in weights.values())
