"""The long-trace grid in miniature: trace scoring, retention with the transition levels on held-out traces,
and a kill -9 in the middle resumed to the same tables."""

import json
from pathlib import Path

import pytest

from rpb.toyworld.grids import grids
from rpb.toyworld.grids.cot import COT_POST
from rpb.toyworld.grids.full import PAPER_METHODS
from rpb.toyworld.study.cells import TRANSITION_KEYS
from rpb.toyworld.world.post import eval_tasks
from rpb.toyworld.world.tasks import DOMAINS, TRACE_SETS
from tests.toyworld_mini import kill_after_first_cell, mini_study

GRIDS = grids()


def _results(out: Path):
    return [{k: v for k, v in r.items() if k != "seconds"} for r in json.loads((out / "results.json").read_text())]


@pytest.fixture(scope="module")
def finished(tmp_path_factory):
    root = tmp_path_factory.mktemp("cot")
    study = mini_study(root / "a", root / "cache", "mini-cot")
    return root, study, study.report(study.run())


def test_the_cot_grid_is_what_the_issue_asks():
    cot = GRIDS["cot"]
    assert cot.sets == TRACE_SETS == ("sum_trace",) and cot.bases == (0,) and cot.seeds == (42, 43, 44)
    assert [a.method for a in cot.arms] == [
        "sft",
        "lbl",
        "rpb",
        "within-soft",
        "within-hard",
        "within-transition-soft",
        "within-transition-hard",
    ]
    assert not {"within-transition-soft", "within-transition-hard"} & set(PAPER_METHODS)  # rpb's own controls
    assert cot.post is COT_POST and COT_POST.max_seq_len == 128 and COT_POST.score_parts == ("validation", "test")
    assert "cot" in cot.tables


def test_cells_score_traces_and_measure_both_retention_levels_on_traces(finished):
    root, study, tables = finished
    out = root / "a"
    probe = [json.loads(line) for line in (out / "data" / "probe.jsonl").read_text().splitlines()]
    held = eval_tasks("sum_trace", "test", 12, study.post.base.domain_params())
    assert [row["messages"][1]["content"] for row in probe] == [t.question for t in held]  # traces alone
    for r in _results(out):
        assert set(r["per_domain"]) == {"sum_trace", *DOMAINS} and r["id"] == r["per_domain"]["sum_trace"]
        assert 0 <= r["id_lines"] <= 1  # the line score, beside the final-line one
        assert set(r["scores"]) == {"test"} and "id_lines" in r["scores"]["test"]
        assert set(r["retention"]) == {"tvd", "jsd", "topk_overlap", "nmi", *TRANSITION_KEYS}
        cell = out / "runs" / "sum_trace" / r["arm"] / "seed42"
        report = json.loads((cell / "retention" / "report.json").read_text())
        for key in TRANSITION_KEYS:  # the cell keeps what `rpb retention --transitions --steps-by` wrote
            assert r["retention"][key] == report["mean"][key]
        # line steps: one answer of n lines has n steps, so every row gives the step level something to count
        assert report["mean"]["step_transition_communities_base"] >= 1
    header = next(line for line in tables.splitlines() if line.startswith("| method |"))
    assert header == (
        "| method | ID % | ID lines % | OOD % | TVD | NMI | transition TVD | transition row JSD | "
        "transition NMI | step NMI |"
    )
    sft = next(line for line in tables.splitlines() if line.startswith("| sft |"))
    r = next(r for r in _results(out) if r["arm"] == "sft")
    assert sft.startswith(f"| sft | {100 * r['id']:.1f} | {100 * r['id_lines']:.1f} | {100 * r['ood']:.1f} | ")
    assert sft.endswith(f" | {r['retention']['transition_nmi']:.3f} | {r['retention']['step_transition_nmi']:.3f} |")
    base = json.loads((out / "base_scores" / "sum_trace.json").read_text())
    assert "id_lines" in base


def test_killed_mid_run_resumes_to_the_same_tables(finished):
    root, _, tables = finished
    out = root / "b"
    assert kill_after_first_cell(out, root / "cache", "mini-cot") < 2
    study = mini_study(out, root / "cache", "mini-cot")
    assert study.report(study.run()) == tables
    assert _results(out) == _results(root / "a")


def test_score_of_a_trace_set_against_answers_scored_by_hand(monkeypatch):
    """score() with the model's answers replaced by chosen ones: per trace, right final line or not and the
    share of right lines are known, so ID and ID lines are hand sums."""
    from rpb.toyworld.world import post as world

    def answers(model, tokenizer, tasks):
        out = []
        for i, t in enumerate(tasks):
            lines = t.answer.split("\n")
            if t.domain != "sum_trace" or i % 3 == 0:
                out.append(t.answer)  # all right
            elif i % 3 == 1:
                out.append("\n".join(["x", *lines[1:]]))  # final line right, first line wrong
            else:
                out.append("\n".join(lines[:2]))  # two lines, the final one missing
        return out

    monkeypatch.setattr(world, "greedy_answers", answers)
    monkeypatch.setattr(world, "load_tokenizer", lambda path: None)
    monkeypatch.setattr(world, "load_causal_lm", lambda path, **kernel: None)
    post = COT_POST
    tasks = eval_tasks("sum_trace", "test", post.eval_id, post.base.domain_params())
    n = [len(t.answer.split("\n")) for t in tasks]
    kinds = [i % 3 for i in range(len(tasks))]
    want_id = sum(k in (0, 1) for k in kinds) / len(tasks)
    want_lines = sum({0: 1.0, 1: (m - 1) / m, 2: 2 / m}[k] for k, m in zip(kinds, n, strict=True)) / len(tasks)
    got = world.score("unused", "sum_trace", post, "test")
    assert got["id"] == pytest.approx(want_id) and got["id_lines"] == pytest.approx(want_lines)
    assert got["ood"] == 1.0 and got["per_domain"]["sum_trace"] == got["id"]
    assert "id_lines" not in world.score("unused", "math_post", post, "test")  # short sets keep their keys


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
