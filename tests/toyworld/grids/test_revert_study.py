"""One base of the ``revert`` grid in miniature: each cell scored as the grids score it and reverted on the grid's
domains, its figures read against the scoring's own exact match (``world.score``) and the revert's own report;
an RL arm trains through the ``rl`` grid's study and is reverted to its start too."""

from __future__ import annotations

import json

import pytest

from rpb.toyworld.world.generators import DOMAINS
from rpb.toyworld.world.post import eval_tasks, score, to_messages
from rpb.toyworld.world.rl import RLArm

pytestmark = pytest.mark.usefixtures("one_thread")


def test_each_cell_is_scored_and_reverted_on_every_domain(revert_finished):
    study, results = revert_finished
    assert [(r["arm"], r["seed"]) for r in results] == [("sft", 42), ("kl-to-base", 42)]
    assert results[0]["anchor"] == {} and results[1]["anchor"] == {"lambda_": 0.01}  # the full grid's weight
    base_scores = score(study.base(), "math_post", study.post, "test")["per_domain"]
    for r in results:
        ckpt = study.out / "runs" / "math_post" / r["arm"] / "seed42" / "model"
        assert r["scores"]["test"] == score(ckpt, "math_post", study.post, "test")
        figures = r["revert"]["base"]
        assert list(figures) == ["math_post", *DOMAINS] and "start" not in r["revert"]
        for d, e in figures.items():
            v = e["variants"]
            assert v["post"]["exact_match"] == r["scores"]["test"]["per_domain"][d], (r["arm"], d)
            assert v["base"]["exact_match"] == base_scores[d] and v["base"]["topk_overlap"] == 1.0
            assert e["delta_nll"] == pytest.approx(v["post+base routers"]["nll"] - v["post"]["nll"], abs=1e-9)
            lo, hi = e["delta_nll_ci"]
            assert lo <= e["delta_nll"] <= hi and "nll_rows" not in v["post"]
        assert not list((study.out / "runs").glob("*/*/*/revert_*")), "the revert's folders are removed"


def test_the_domains_are_the_test_questions_the_grids_score(revert_finished):
    study, _ = revert_finished
    params = study.post.base.domain_params()
    for d in ("math_post", *DOMAINS):
        rows = [json.loads(line)["messages"] for line in study.domain_file(d).read_text().splitlines()]
        n = study.post.eval_id if d == "math_post" else study.post.eval_ood
        assert rows == [to_messages(t) for t in eval_tasks(d, "test", n, params)], d


def test_an_rl_arm_trains_through_the_rl_study_and_is_reverted_to_its_start(revert_finished, monkeypatch):
    study, results = revert_finished
    seen = []
    monkeypatch.setattr(type(study.rl), "train", lambda self, *args: seen.append(args) or ("ckpt", 1.0, {}))
    arm = RLArm("grpo")
    assert study.train(study.out / "x", "math_post", arm, 43, {}) == ("ckpt", 1.0, {})
    assert seen == [(study.out / "x", "math_post", arm, 43, {})]
    ckpt = study.out / "runs" / "math_post" / "sft" / "seed42" / "model"
    figures = study.measure(study.out / "probe-cell", ckpt, "math_post", {"start_sha256": "s"})["revert"]
    assert set(figures) == {"base", "start"} and figures["base"] == results[0]["revert"]["base"]
    start = study.rl.start()
    start_scores = score(start, "math_post", study.post, "test")["per_domain"]
    assert all(figures["start"][d]["variants"]["base"]["exact_match"] == start_scores[d] for d in start_scores)
