"""The grids' definitions: their sizes, arms and recipes, against values counted by hand."""

from __future__ import annotations

from rpb.toyworld.grids import (
    BETA_ARMS,
    CALIBRATED,
    COT_POST,
    GRIDS,
    STUDY_POST,
    TRANSITION_KEYS,
    Arm,
    table_weights,
)


def test_an_arms_slug_drops_spaces_and_equals_signs():
    assert Arm("rpb beta=0.25", "rpb").slug == "rpbbeta0.25"
    assert Arm("rpb calibrated", "rpb").slug == "rpbcalibrated"
    assert Arm("kl-to-base", "kl-to-base").slug == "kl-to-base"


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


def test_grid_sizes_counted_by_hand():
    def cells(name: str) -> int:
        g = GRIDS[name]
        return len(g.sets) * len(g.arms) * len(g.seeds) * len(g.bases)

    assert cells("headline") == 2 * 4 * 5 * 3  # sft, lbl, rpb, calibrated; five seeds; three bases
    assert cells("demo") == 1 * 4 * 1 * 1
    assert cells("small") == 1 * 4 * 1 * 1
    assert cells("cot") == 1 * 7 * 3 * 1
    assert cells("beta") == 2 * 7 * 3 * 3


def test_the_demo_fixes_its_weight_and_runs_the_calibrated_arm():
    demo = GRIDS["demo"]
    assert demo.sets == ("math_post",) and demo.seeds == (42,) and demo.coefficients == {"lbl": 0.01}
    assert demo.arms[-1] == CALIBRATED and CALIBRATED.calibrated and CALIBRATED.method == "rpb"
    assert demo.post is None  # the demo keeps PostRecipe()


def test_the_study_recipes():
    assert (STUDY_POST.eval_id, STUDY_POST.eval_ood) == (500, 300)
    assert STUDY_POST.score_parts == ("validation", "test")
    assert COT_POST.max_seq_len == 128 and COT_POST.eval_id == 500  # the grids' scoring, longer sequences
    assert GRIDS["cot"].post is COT_POST and GRIDS["full"].post is STUDY_POST


def test_transition_keys_name_both_levels():
    assert TRANSITION_KEYS == (
        "transition_nmi",
        "transition_tvd",
        "transition_row_jsd",
        "transition_communities_base",
        "step_transition_nmi",
        "step_transition_tvd",
        "step_transition_row_jsd",
        "step_transition_communities_base",
    )


def test_table_weights_keep_only_weighted_methods():
    weights = table_weights()
    assert "sft" not in weights  # no anchor, nothing to weigh
    assert all(isinstance(w, tuple) and w for w in weights.values())
    assert GRIDS["full"].candidates == weights
