"""The hold grid: its claims judged on hand-made cells (each rule against the bootstrap interval it reads), its
arms' selections, and the data-mixing rows, which must share no question with any validation, test or probe
question."""

from __future__ import annotations

import math

import numpy as np
import pytest

from rpb.toyworld.grids.hold import (
    GRID,
    HOLD_ARMS,
    MIX_SHARE,
    OVERLAP_GAIN,
    ROUTES_SELECTION,
    HoldStudy,
    judge_hold,
)
from rpb.toyworld.study.grid import STUDY_POST
from rpb.toyworld.study.stats import interval, two_stage_bootstrap
from rpb.toyworld.world.generators import DOMAINS, POST_SETS
from rpb.toyworld.world.post import PARTS, eval_tasks, mixing_tasks, probe_tasks

SETS = ("math_post",)


def cells(shift: dict[str, dict[str, float]], noise: float = 0.01, seed: int = 0) -> list[dict]:
    """3 bases x 3 seeds of every arm on math_post: each figure a common base value plus the arm's shift and noise."""
    rng = np.random.default_rng(seed)
    out = []
    for arm in (a.label for a in HOLD_ARMS):
        for base in (0, 1, 2):
            for s in (42, 43, 44):
                add = shift.get(arm, {})
                out.append({
                    "arm": arm, "set": "math_post", "base": base, "seed": s,
                    "id": 0.5 + add.get("id", 0.0) + noise * rng.standard_normal(),
                    "ood": 0.2 + add.get("ood", 0.0) + noise * rng.standard_normal(),
                    "retention": {"topk_overlap": 0.5 + add.get("topk_overlap", 0.0) + noise * rng.standard_normal()},
                })  # fmt: skip
    return out


def by_claim(verdicts, number: str):
    (v,) = [v for v in verdicts if v.claim.startswith(f"({number})")]
    return v


def test_routing_kd_holding_the_routing_and_keeping_ood_reproduces_its_claims():
    results = cells({
        "routing-kd": {"topk_overlap": 0.3, "ood": 0.1}, "routing-kd routes": {"topk_overlap": 0.3, "ood": 0.1},
        "output-kd": {"ood": 0.05}, "mix + routing-kd": {"ood": 0.15, "topk_overlap": 0.3}, "mix": {"ood": 0.05},
    })  # fmt: skip
    verdicts = judge_hold(results, SETS)
    for number in ("1", "2", "3", "4a", "4b", "5", "7", "8"):
        assert by_claim(verdicts, number).holm == "reproduces", number
    assert by_claim(verdicts, "6").holm == "outside Holm" and by_claim(verdicts, "6").verdict == "reproduces"


def test_claim_one_reads_the_lower_bound_against_the_gain_not_against_zero():
    # +0.05 overlap: above sft, yet below the +0.1 the claim asks: contradicted, not reproduced
    results = cells({"routing-kd": {"topk_overlap": 0.05}}, noise=0.001)
    v = by_claim(judge_hold(results, SETS), "1")
    diffs = {b: [0.0] * 3 for b in (0, 1, 2)}
    for r in results:
        if r["arm"] == "routing-kd":
            ref = next(x for x in results if x["arm"] == "sft" and (x["base"], x["seed"]) == (r["base"], r["seed"]))
            diffs[r["base"]][(r["seed"] - 42)] = r["retention"]["topk_overlap"] - ref["retention"]["topk_overlap"]
    lo, hi = interval(two_stage_bootstrap(diffs))
    assert hi < OVERLAP_GAIN and v.verdict == "contradicted" and v.ci == pytest.approx((lo, hi))


def test_an_arm_not_run_is_named_and_kept_out_of_holm():
    results = [r for r in cells({}) if r["arm"] != "output-kd"]
    verdicts = judge_hold(results, SETS)
    assert by_claim(verdicts, "5").verdict == "not run" and by_claim(verdicts, "6").holm == "not run"
    assert all(math.isnan(v.p) for v in verdicts if v.verdict == "not run")


def test_each_arm_reads_its_own_selection_and_the_mixed_one_the_online_weight(tmp_path):
    study = HoldStudy(tmp_path, GRID, STUDY_POST, None, False)
    keys = {a.label: study.selection_key(a) for a in HOLD_ARMS}
    assert keys == {
        "sft": None, "routing-kd": "routing-kd", "routing-kd routes": ROUTES_SELECTION, "output-kd": "output-kd",
        "kl-to-base": "kl-to-base", "mix": None, "mix + routing-kd": "routing-kd", "rpb": None,
    }  # fmt: skip
    assert study.selected_keys() == ["output-kd", "routing-kd", ROUTES_SELECTION]  # kl-to-base is fixed
    assert dict(study.selection_arm(ROUTES_SELECTION).anchor) == {"base": "routes", "routes_loss": "set-ce"}


def test_the_mixing_rows_are_training_questions_no_evaluation_or_probe_question_repeats(tmp_path):
    post = STUDY_POST
    params = post.base.domain_params()
    sizes = {d: post.eval_ood for d in DOMAINS} | {s: post.eval_id for s in POST_SETS}  # as the grids score them
    held = {t.question for d, n in sizes.items() for part in PARTS for t in eval_tasks(d, part, n, params)}
    held |= {t.question for t in probe_tasks(post)}
    n = math.ceil(MIX_SHARE / len(DOMAINS) * post.train_rows)
    for domain in DOMAINS:
        rows = mixing_tasks(domain, n, post)
        assert len(rows) == n and len({t.question for t in rows}) == n
        assert not {t.question for t in rows} & held, domain


def test_a_running_base_keeps_its_retrained_revert_cells_with_its_runs(tmp_path):
    """The revert cells are finished work too: an unfinished base ships them beside its runs, so a grid resumed on
    another machine does not train them again."""
    from rpb.toyworld.study.shipping import keep_unfinished

    st = HoldStudy(tmp_path / "run" / "base0", GRID, STUDY_POST, None, False)
    files = ["grid.json", "selection/output-kd-0.1/result.json", "revert/math_post/sft/seed42/result.json"]
    for rel in files:
        (st.out / rel).parent.mkdir(parents=True, exist_ok=True)
        (st.out / rel).write_text("{}")
    keep_unfinished(st, tmp_path / "dest")
    kept = tmp_path / "dest" / "unfinished" / "base0"
    assert all((kept / rel).is_file() for rel in files)
