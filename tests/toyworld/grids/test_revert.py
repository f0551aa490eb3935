"""The ``revert`` grid's set-up and claim: its arms are the shipped ``full`` and ``rl`` grids' arms with their
recipes, the ``kl-to-base`` weight is the one the ``full`` grid chose on each base, and the claim is judged by the
grids' bootstrap on the per-cell changes (hand-made cells: a reproduced, a contradicted and a missing claim)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from rpb.toyworld.grids import grids
from rpb.toyworld.grids.revert import GRID as REVERT_GRID
from rpb.toyworld.grids.revert import KL_WEIGHT, TRAINED, changes, judge_revert
from rpb.toyworld.grids.rl import GRID as RL_GRID
from rpb.toyworld.study.grid import STUDY_POST
from rpb.toyworld.world.generators import DOMAINS

GRIDS = grids()

SHIPPED = Path(__file__).resolve().parents[3] / "docs" / "results"


def test_the_arms_and_recipes_are_the_shipped_grids():
    full = {a.label: a for a in GRIDS["full"].arms}
    rl = {a.label: a for a in RL_GRID.arms}
    assert [a.label for a in REVERT_GRID.arms] == ["sft", "rpb", "kl-to-base", "grpo", "grpo + R3"]
    for arm in REVERT_GRID.arms:
        assert arm == (full.get(arm.label) or rl[arm.label]), arm.label
    assert REVERT_GRID.post == STUDY_POST == GRIDS["full"].post == RL_GRID.post
    assert REVERT_GRID.recipe == RL_GRID.recipe and REVERT_GRID.start_seed == RL_GRID.start_seed
    assert (REVERT_GRID.seeds, REVERT_GRID.bases, REVERT_GRID.sets) == (GRIDS["full"].seeds, (0, 1, 2), (TRAINED,))
    assert REVERT_GRID.domains == (TRAINED, *DOMAINS)
    rl_part = REVERT_GRID.rl_grid()
    assert [a.label for a in rl_part.arms] == ["grpo", "grpo + R3"] and rl_part.recipe == RL_GRID.recipe


def test_the_kl_weight_is_the_one_the_full_grid_chose_on_every_base():
    chosen = [json.loads((SHIPPED / "full" / f"base{b}" / "selection.json").read_text())["chosen"] for b in (0, 1, 2)]
    assert [c["kl-to-base"] for c in chosen] == [KL_WEIGHT] * 3
    assert REVERT_GRID.coefficients == {"kl-to-base": KL_WEIGHT}


def _cell(base, seed, trained, untargeted, arm="sft"):
    sets = {TRAINED: {"delta_nll": trained}} | {d: {"delta_nll": untargeted + i / 100} for i, d in enumerate(DOMAINS)}
    return {"arm": arm, "base": base, "seed": seed, "revert": {"base": sets}}


def test_the_claim_is_judged_on_the_cells_changes():
    cells = [_cell(b, s, 0.05 + 0.01 * s, 0.03 - 0.002 * b) for b in range(3) for s in range(3)]
    assert changes(cells, "sft", DOMAINS)[1] == pytest.approx([0.028 + 0.015] * 3)  # the four domains' mean
    assert changes(cells, "sft", (TRAINED,))[0] == pytest.approx([0.05, 0.06, 0.07])
    raised, lowered = judge_revert(cells)
    assert (raised.verdict, lowered.verdict) == ("reproduces", "contradicted")
    flipped = [_cell(b, s, -0.05, -0.1) for b in range(3) for s in range(3)]
    raised, lowered = judge_revert(flipped)
    assert (raised.verdict, lowered.verdict) == ("contradicted", "reproduces")
    assert raised.estimate == pytest.approx(-0.05) and lowered.estimate == pytest.approx(-0.1 + 0.015)
    assert [v.verdict for v in judge_revert([_cell(0, 42, 1.0, 1.0, arm="rpb")])] == ["not run", "not run"]
