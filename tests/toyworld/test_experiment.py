"""The toy-world study at miniature size: a grid runs, resumes after kill -9 to the same tables, and refuses
a changed set-up; evaluation splits and tables against hand computations."""

import json
import shutil
from dataclasses import replace
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from rpb.toyworld.experiment import GRIDS, GridChangedError, Study
from rpb.toyworld.tables import table
from rpb.toyworld.tasks import DOMAINS, POST_SETS, sample, split_of
from rpb.toyworld.world import eval_tasks, part_of, probe_tasks
from tests.toyworld_mini import MINI_GRID, MINI_POST, kill_after_first_cell, mini_study


def _without_timing(results):
    return [{k: v for k, v in r.items() if k != "seconds"} for r in results]


def _results(out: Path):
    return _without_timing(json.loads((out / "results.json").read_text()))


@pytest.fixture(scope="module")
def finished(tmp_path_factory):
    """One uninterrupted miniature study (its base is built into a shared cache)."""
    root = tmp_path_factory.mktemp("study")
    study = mini_study(root / "a", root / "cache")
    tables = study.report(study.run())
    return root, tables


def test_miniature_grid_writes_tables_results_and_plots(finished):
    root, tables = finished
    out = root / "a"
    results = _results(out)
    assert [(r["arm"], r["seed"], r["part"]) for r in results] == [("lbl", 42, "test"), ("rpb", 42, "test")]
    for r in results:
        assert (
            r["mechanism"]["start_displacement"] is None
            if r["method"] == "lbl"
            else 0 <= r["mechanism"]["start_displacement"] <= 1
        )
        assert set(r["per_domain"]) == {"math_post", *DOMAINS}
        assert r["id"] == r["per_domain"]["math_post"]
        assert r["ood"] == pytest.approx(sum(r["per_domain"][d] for d in DOMAINS) / 4)
        assert set(r["retention"]) == {"tvd", "jsd", "topk_overlap", "nmi"}
        assert 0 <= r["retention"]["tvd"] <= 1 and 0 <= r["retention"]["topk_overlap"] <= 1
        assert r["threads"] == torch.get_num_threads()  # what a bit-identical redo needs besides the machine
        # the cell's own retention report, as `rpb retention` writes it
        report = json.loads(
            (out / "runs" / "math_post" / r["arm"] / "seed42" / "retention" / "report.json").read_text()
        )
        assert report["mean"]["tvd"] == r["retention"]["tvd"]
        assert not (out / "runs" / "math_post" / r["arm"] / "seed42" / "model").exists()  # checkpoints dropped
    assert (out / "tradeoff.png").stat().st_size > 0 and (out / "retention.png").stat().st_size > 0
    assert tables in (out / "tables.md").read_text()
    assert "| lbl |" in tables and "| rpb |" in tables
    base = json.loads((out / "base_scores" / "math_post.json").read_text())
    assert f"| *base (before post-training)* | {100 * base['id']:.1f} | {100 * base['ood']:.1f} | — | — | — |" in tables


def test_weights_are_chosen_on_the_validation_split(finished):
    root, _ = finished
    sel = json.loads((root / "a" / "selection.json").read_text())
    assert sel["part"] == "validation" and [t["weight"] for t in sel["trials"]] == [0.01, 0.1]
    score = {t["weight"]: (t["id"] + t["ood"]) / 2 for t in sel["trials"]}
    best = max(score.values())
    assert sel["chosen"]["lbl"] == min(w for w, s in score.items() if s == best)  # ties: the weaker anchor
    for w in (0.01, 0.1):
        trial = json.loads((root / "a" / "selection" / f"lbl-{w:g}" / "result.json").read_text())
        assert trial["part"] == "validation" and trial["anchor"] == {"lbl_coef": w} and "retention" not in trial
    used = [r for r in _results(root / "a") if r["arm"] == "lbl"]
    assert used[0]["anchor"] == {"lbl_coef": sel["chosen"]["lbl"]}


def test_killed_mid_run_resumes_to_the_same_tables(finished):
    root, tables = finished
    out = root / "b"
    assert kill_after_first_cell(out, root / "cache") < 4

    study = mini_study(out, root / "cache")
    assert study.report(study.run()) == tables
    assert (out / "tables.md").read_text() == (root / "a" / "tables.md").read_text()
    assert _results(out) == _results(root / "a")


def test_a_changed_set_up_is_refused(finished, tmp_path):
    root, _ = finished
    cache = root / "cache"
    pinned = (root / "a" / "grid.json").read_text()
    with pytest.raises(GridChangedError, match="post_recipe"):
        Study(root / "a", MINI_GRID, replace(MINI_POST, max_steps=4), cache_dir=cache).pin()
    with pytest.raises(GridChangedError, match="grid"):
        Study(root / "a", replace(MINI_GRID, seeds=(42, 43)), MINI_POST, cache_dir=cache).pin()
    # same recipe, other weights (a base rebuilt elsewhere): a resume must not mix two bases
    other = tmp_path / "cache"
    shutil.copytree(cache, other)
    (weights,) = other.glob("toyworld/base-*/model.safetensors")
    tensors = load_file(weights)
    name = sorted(tensors)[0]
    tensors[name] = tensors[name] + 1e-3
    save_file(tensors, weights, metadata={"format": "pt"})
    with pytest.raises(GridChangedError, match=r"base_sha256 \(the base model's weights\)"):
        Study(root / "a", MINI_GRID, MINI_POST, cache_dir=other).pin()
    assert (root / "a" / "grid.json").read_text() == pinned


def test_evaluation_parts_are_disjoint_held_out_and_fixed():
    params = MINI_POST.base.domain_params()
    for domain in (*DOMAINS, *POST_SETS):
        val, test = (eval_tasks(domain, p, 40, params) for p in ("validation", "test"))
        assert val and test and val == eval_tasks(domain, "validation", 40, params)
        assert {split_of(t) for t in val + test} == {"heldout"}
        assert not {t.question for t in val} & {t.question for t in test}
        assert {part_of(t) for t in val} == {"validation"} and {part_of(t) for t in test} == {"test"}
    facts = eval_tasks("facts", "validation", 1000, params) + eval_tasks("facts", "test", 1000, params)
    assert len(facts) == 150  # every held-out phrasing of the 50-entity knowledge base, once
    train = {t.question for t in sample("math_post", 2000, seed=0)}
    assert not train & {t.question for t in eval_tasks("math_post", "test", 100, params)}
    probe = probe_tasks(MINI_POST)
    assert {t.domain for t in probe} == {*DOMAINS, *POST_SETS} and len(probe) == 24


def test_tables_show_mean_and_sample_std_over_seeds():
    def result(arm, seed, id_, ood, tvd):
        return {"set": "math_post", "arm": arm, "method": arm, "seed": seed, "id": id_, "ood": ood,
                "retention": {"tvd": tvd, "topk_overlap": 0.5, "nmi": 1.0, "jsd": 0.1}}  # fmt: skip

    results = [result("sft", 1, 0.5, 0.2, 0.3), result("sft", 2, 0.7, 0.4, 0.5), result("rpb", 1, 0.9, 0.8, 0.1),
               result("rpb-hard", 1, 0.1, 0.1, 0.1)]  # fmt: skip
    text = table("forms", results, ("math_post",), ("sft", "rpb", "rpb-hard"))
    rows = [line for line in text.splitlines() if line.startswith("| ") and "method" not in line]
    # grid order, and only the methods the methods table lists among the forms (not rpb-hard);
    # sft: mean 60.0, sample std sqrt(((50-60)^2 + (70-60)^2) / 1) = 14.142...
    assert rows == [
        "| sft | 60.0 ± 14.1 | 30.0 ± 14.1 | 0.400 ± 0.141 | 0.500 ± 0.000 |",
        "| rpb | 90.0 | 80.0 | 0.100 | 0.500 |",
    ]
    main = table("main", results, ("math_post",), ("sft", "rpb", "rpb-hard"))
    assert "| rpb-hard | 10.0 | 10.0 |" in main


def test_the_grids_are_what_the_docs_say():
    full = GRIDS["full"]
    assert len(full.arms) == 11 and full.seeds == (42, 43, 44) and full.sets == POST_SETS and full.bases == (0, 1, 2)
    assert len(full.sets) * len(full.arms) * len(full.seeds) * len(full.bases) == 198
    headline = GRIDS["headline"]
    assert [a.label for a in headline.arms] == ["sft", "lbl", "rpb", "rpb calibrated"] and headline.arms[-1].calibrated
    assert len(headline.sets) * len(headline.arms) * len(headline.seeds) * len(headline.bases) == 72
    for name in ("headline", "full", "beta"):  # the larger test sets, both parts scored
        post = GRIDS[name].post
        assert (post.eval_id, post.eval_ood, post.score_parts) == (500, 300, ("validation", "test"))
    assert [a.label for a in GRIDS["demo"].arms] == ["sft", "lbl", "rpb", "rpb calibrated"]
    assert GRIDS["demo"].post is None and GRIDS["demo"].bases == (0,)  # the demo keeps today's test sets
    betas = [dict(a.anchor).get("beta") for a in GRIDS["beta"].arms]
    assert betas == [0.0, 0.25, 0.5, 1.0, 2.0, 4.0, None] and GRIDS["beta"].arms[-1].method == "rpb-hard"
