"""The grids, one module each in ``rpb.toyworld.grids``: found by name or as ``module:ATTR``, and their definitions
(sizes, arms, recipes) against values counted by hand."""

from __future__ import annotations

import sys

import pytest

from rpb.errors import RpbError
from rpb.toyworld.grids import find, grids
from rpb.toyworld.grids.beta import BETA_ARMS
from rpb.toyworld.grids.cot import COT_POST
from rpb.toyworld.grids.demo import GRID as DEMO
from rpb.toyworld.grids.full import GRID as FULL
from rpb.toyworld.grids.full import PAPER_METHODS
from rpb.toyworld.grids.headline import GRID as HEADLINE
from rpb.toyworld.grids.small import GRID as SMALL
from rpb.toyworld.study.grid import CALIBRATED, STUDY_POST, table_weights

GRIDS = grids()


def test_every_grid_module_declares_one_grid_found_by_its_name():
    assert list(GRIDS) == [
        "beta",
        "beta-frequency",
        "cot",
        "demo",
        "full",
        "headline",
        "hold",
        "hold-stored",
        "hold-target",
        "revert",
        "rl",
        "rl-stale",
        "small",
    ]
    assert find("small") is SMALL and find("rpb.toyworld.grids.full:GRID") is FULL
    assert all(g.about for g in GRIDS.values()), "each grid says what it runs, for rpb experiment --help"


def test_a_grid_of_ones_own_is_found_as_module_attr(tmp_path, monkeypatch):
    (tmp_path / "mine.py").write_text(
        "from rpb.toyworld.study.grid import Grid, arms\nMY = Grid('mine', ('math_post',), arms('sft'), (1,))\n"
    )
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.delitem(sys.modules, "mine", raising=False)
    assert find("mine:MY").name == "mine"


@pytest.mark.parametrize(
    ("spec", "says"),
    [
        ("nope", "no grid 'nope': the grids are beta, beta-frequency"),
        ("no_such_module_here:GRID", "cannot import 'no_such_module_here'"),
        ("rpb.toyworld.grids.full:NOPE", "has no 'NOPE'"),
        ("rpb.toyworld.grids.full:PAPER_METHODS", "tuple is not a grid"),
    ],
)
def test_a_spec_that_names_no_grid_is_refused_by_name(spec, says):
    with pytest.raises(RpbError, match=says):
        find(spec)


def test_the_beta_grid_has_one_arm_per_beta_and_the_hard_anchor():
    assert [a.label for a in BETA_ARMS] == [
        "rpb beta=0",
        "rpb beta=0.25",
        "rpb beta=0.5",
        "rpb beta=1",
        "rpb beta=2",
        "rpb beta=4",
        "rpb hard",
    ]
    assert BETA_ARMS[2].anchor == (("beta", 0.5),) and BETA_ARMS[-1].method == "rpb-hard"
    assert GRIDS["beta"].coefficients == {}  # no weight to choose: beta is the arm's own setting
    assert GRIDS["beta"].judges_beta_rule and not HEADLINE.judges_beta_rule


def test_grid_sizes_counted_by_hand():
    def cells(name: str) -> int:
        g = GRIDS[name]
        return len(g.sets) * len(g.arms) * len(g.seeds) * len(g.bases)

    assert cells("headline") == 2 * 4 * 5 * 3  # sft, lbl, rpb, calibrated; five seeds; three bases
    assert cells("demo") == 1 * 4 * 1 * 1
    assert cells("small") == 1 * 4 * 1 * 1
    assert cells("cot") == 1 * 7 * 3 * 1
    assert cells("beta") == 2 * 7 * 3 * 3
    assert cells("full") == 2 * len(PAPER_METHODS) * 3 * 3


def test_the_demo_fixes_its_weight_and_runs_the_calibrated_arm():
    assert DEMO.sets == ("math_post",) and DEMO.seeds == (42,) and DEMO.coefficients == {"lbl": 0.01}
    assert DEMO.arms[-1] == CALIBRATED and CALIBRATED.calibrated and CALIBRATED.method == "rpb"
    assert DEMO.post is None  # the demo keeps PostRecipe()
    assert set(DEMO.tables) - {"main", "forms", "controls", "mechanism"} <= set(DEMO.table_kinds)


def test_the_study_recipes():
    assert (STUDY_POST.eval_id, STUDY_POST.eval_ood) == (500, 300)
    assert STUDY_POST.score_parts == ("validation", "test")
    assert COT_POST.max_seq_len == 128 and COT_POST.eval_id == 500  # the grids' scoring, longer sequences
    assert GRIDS["cot"].post is COT_POST and FULL.post is STUDY_POST


def test_every_table_a_grid_asks_for_is_a_kind_it_can_make():
    from rpb.toyworld.study.tables import TABLES

    for g in GRIDS.values():
        if g.report is None:  # the paper's tables (a grid with its own report makes its own)
            assert set(g.tables) <= set(TABLES) | set(g.table_kinds), g.name


def test_the_paper_grids_try_the_methods_tables_weights():
    assert FULL.candidates == table_weights() and "sft" not in table_weights()
