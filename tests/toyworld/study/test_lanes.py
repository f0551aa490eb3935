"""Jobs side by side (rpb.toyworld.study.lanes): waits honoured, failures listed together, a dead lane named, and a
miniature study in two lanes giving the same cells and tables as the same study in one process at one thread."""

from __future__ import annotations

import json
import os
from dataclasses import replace
from pathlib import Path

import pytest
import torch

from rpb.cli import build_parser
from rpb.toyworld.study import lanes as lanes_module
from rpb.toyworld.study.lanes import Job, JobsFailedError, default_lanes, lane_threads, run_jobs
from tests.toyworld.study.lane_jobs import die, fail, meet, stamp
from tests.toyworld_mini import mini_study


def test_jobs_run_side_by_side_after_what_they_wait_for(tmp_path, monkeypatch):
    monkeypatch.setattr(lanes_module, "usable_cores", lambda: 2)
    monkeypatch.setenv("OMP_NUM_THREADS", "2")  # what a lane would keep (the cores, at most 2) without its share
    here = str(tmp_path)
    # c waits for a, listed before b: with waits ignored it would take the second lane before b
    jobs = [
        Job(meet, (here, "a", "b")),
        Job(stamp, (here, "c", 0.0), after=(0,)),
        Job(meet, (here, "b", "a")),
        Job(stamp, (here, "d", 0.0), after=(1, 2)),
    ]
    counted = []
    assert run_jobs(jobs, lanes=2, on_done=lambda job: counted.append(job.args[1])) == ["a", "c", "b", "d"]
    t = {n: json.loads((tmp_path / n).read_text()) for n in "abcd"}
    assert t["a"]["met"] and t["b"]["met"]  # both at once: each saw the other start before it ended
    assert t["a"]["pid"] != t["b"]["pid"] and os.getpid() not in {r["pid"] for r in t.values()}
    assert t["c"]["start"] >= t["a"]["end"] and t["d"]["start"] >= max(t["b"]["end"], t["c"]["end"])
    assert {r["threads"] for r in t.values()} == {1}  # two cores shared by two lanes
    assert sorted(counted) == ["a", "b", "c", "d"] and counted.index("c") > counted.index("a")


def test_failures_are_reported_together_and_nothing_new_starts(tmp_path):
    jobs = [
        Job(fail, ("first",), label="one"),
        Job(fail, ("second",), label="two"),
        Job(stamp, (str(tmp_path), "later", 0.0), label="later"),
    ]
    with pytest.raises(JobsFailedError) as caught:
        run_jobs(jobs, lanes=2)
    message = str(caught.value)
    assert "2 job(s) failed (1 not run" in message
    assert "one: ValueError: first" in message and "two: ValueError: second" in message
    assert isinstance(caught.value.__cause__, ValueError)  # the first failure, with its lane's traceback:
    assert "raise ValueError(message)" in str(caught.value.__cause__.__cause__)
    assert not (tmp_path / "later").exists()


def test_a_lane_that_dies_is_named_with_the_likely_causes(tmp_path):
    jobs = [Job(die, label="the dying one"), Job(stamp, (str(tmp_path), "x", 0.0))]
    with pytest.raises(JobsFailedError, match="the dying one: its process ended abruptly: killed, out of memory"):
        run_jobs(jobs, lanes=2)


def test_in_one_lane_the_jobs_run_here_in_order_and_a_wait_on_a_later_job_is_refused(tmp_path):
    jobs = [Job(stamp, (str(tmp_path), "a", 0.0)), Job(stamp, (str(tmp_path), "b", 0.0))]
    assert run_jobs(jobs, lanes=1) == ["a", "b"]
    assert {json.loads((tmp_path / n).read_text())["pid"] for n in "ab"} == {os.getpid()}
    with pytest.raises(ValueError, match=r"job 0 \(x\) waits for \(1,\)"):
        run_jobs([Job(stamp, (str(tmp_path), "a", 0.0), after=(1,), label="x"), jobs[1]], lanes=2)


def test_the_default_is_a_lane_per_usable_core_at_most_eight(monkeypatch):
    for cores, lanes in ((1, 1), (2, 2), (16, 8)):
        monkeypatch.setattr(lanes_module, "usable_cores", lambda c=cores: c)
        assert default_lanes() == lanes
    monkeypatch.setattr(lanes_module, "usable_cores", lambda: 6)
    assert (lane_threads(2), lane_threads(4), lane_threads(8)) == (3, 1, 1)


@pytest.mark.parametrize("command", ["demo", "experiment"])
def test_lanes_on_the_command_line_are_a_whole_number_of_at_least_one(command, capsys):
    assert build_parser().parse_args([command, "--lanes", "3"]).lanes == 3
    for bad in ("0", "-1", "two"):
        with pytest.raises(SystemExit):
            build_parser().parse_args([command, "--lanes", bad])
        assert "a whole number of at least 1" in capsys.readouterr().err


def _cells(out: Path) -> list[dict]:
    return [{k: v for k, v in r.items() if k != "seconds"} for r in json.loads((out / "results.json").read_text())]


def test_a_study_in_two_lanes_equals_the_same_study_in_one_process_at_one_thread(tmp_path, monkeypatch):
    monkeypatch.setattr(lanes_module, "usable_cores", lambda: 2)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # what each of two lanes on two cores gets
    try:
        one = mini_study(tmp_path / "one", tmp_path / "cache")
        tables = one.report(one.run())
    finally:
        torch.set_num_threads(threads)
    two = replace(mini_study(tmp_path / "two", tmp_path / "cache"), lanes=2)
    assert two.report(two.run()) == tables
    assert _cells(tmp_path / "two") == _cells(tmp_path / "one")
    assert {r["threads"] for r in _cells(tmp_path / "two")} == {1}
    for name in ("selection.json", "base_scores/math_post.json", "calibration/math_post/calibrate.json"):
        assert (tmp_path / "two" / name).is_file() == (tmp_path / "one" / name).is_file()
        if (tmp_path / "one" / name).is_file():
            assert (tmp_path / "two" / name).read_text() == (tmp_path / "one" / name).read_text()
    routing = [json.loads((tmp_path / w / "base_routing" / "report.json").read_text())["mean"] for w in ("one", "two")]
    assert routing[0] == routing[1]
