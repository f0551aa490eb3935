"""A study's shared inputs: made once in its folder, then read back, never remade."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from rpb.toyworld.grids import grids
from rpb.toyworld.study import inputs
from rpb.toyworld.study.inputs import StudyInputs
from rpb.toyworld.world.post import PostRecipe
from rpb.toyworld.world.tasks import Task, split_of

GRIDS = grids()


def _never(*args, **kwargs):
    pytest.fail("a finished input was made again")


def test_the_base_seed_overrides_the_recipes(tmp_path):
    st = StudyInputs(str(tmp_path), GRIDS["demo"], PostRecipe(), base_seed=2)
    assert isinstance(st.out, Path) and st.post.base.seed == 2
    assert PostRecipe().base.seed == 0  # the recipe given is left alone


def test_the_trace_set_is_the_grids_long_trace_set(tmp_path):
    assert StudyInputs(tmp_path, GRIDS["cot"]).trace_set == "sum_trace"
    assert StudyInputs(tmp_path, GRIDS["headline"]).trace_set is None


def test_the_training_rows_are_distinct_training_questions_written_once(tmp_path, monkeypatch):
    st = StudyInputs(tmp_path, GRIDS["demo"], PostRecipe(train_rows=50))
    path = st.data("math_post")
    assert path == tmp_path / "data" / "math_post.train.jsonl"
    rows = [json.loads(line) for line in path.read_text().splitlines()]
    assert len(rows) == 50
    questions = [r["messages"][1]["content"] for r in rows]  # after the empty system turn
    assert len(set(questions)) == 50 and all(q.startswith("rev ") and q.count("+") == 2 for q in questions)
    for r in rows:
        a, b, c = r["messages"][1]["content"].removeprefix("rev ").removesuffix("=").split("+")
        assert r["messages"][2]["content"] == str(int(a) + int(b) + int(c))[::-1]
    monkeypatch.setattr(inputs, "sample", _never)
    assert st.data("math_post") == path


def test_finished_inputs_are_read_back(tmp_path, monkeypatch):
    for name in ("score", "ensure_base", "write_rows", "probe_tasks"):
        monkeypatch.setattr(inputs, name, _never)
    st = StudyInputs(tmp_path, GRIDS["demo"])
    (tmp_path / "base_scores").mkdir()
    (tmp_path / "base_scores" / "math_post.json").write_text('{"id": 0.25, "ood": 0.5}')
    assert st.base_score("math_post") == {"id": 0.25, "ood": 0.5}
    (tmp_path / "calibration" / "math_post").mkdir(parents=True)
    (tmp_path / "calibration" / "math_post" / "calibrate.json").write_text('{"recommended_beta": 0.5}')
    assert st.calibrated_beta("math_post") == 0.5
    (tmp_path / "base_routing").mkdir()
    (tmp_path / "base_routing" / "report.json").write_text('{"mean": {"nmi": 0.75}}')
    assert st.base_routing() == {"mean": {"nmi": 0.75}}
    (tmp_path / "data").mkdir()
    (tmp_path / "data" / "probe.jsonl").write_text("{}\n")
    assert st.probe() == tmp_path / "data" / "probe.jsonl"


def test_the_sampled_rows_are_all_from_the_training_split(tmp_path):
    st = StudyInputs(tmp_path, GRIDS["demo"], PostRecipe(train_rows=30))
    for line in st.data("math_post").read_text().splitlines():
        turns = json.loads(line)["messages"]
        assert split_of(Task("math_post", turns[1]["content"], turns[2]["content"])) == "train"
