"""``rpb routes --chunk-rows N``: the routes as a shard directory, resumable after a kill, read by every reader as
the single route file of the same rows (the teacher's steps, ``rpb collect --from-routes``'s prior, the checks)."""

from __future__ import annotations

import json

import pytest
import torch

import rpb.collect.hf_routes as hf_routes
from rpb.cli import main
from rpb.collect.from_routes import collect_from_routes
from rpb.replay.routefile import RouteFileError
from rpb.replay.routeshards import INDEX, RouteShards, open_routes
from rpb.testing.data import conversations, write_jsonl
from rpb.train.run import prepare_run
from tests.teacher.conftest import MAX_LEN, config

pytestmark = pytest.mark.usefixtures("one_thread")
NAMES = ("routes", "probs", "extra_ids", "extra_probs", "token_ids")


@pytest.fixture(scope="module")
def setup(tmp_path_factory, save_tiny):
    """The teacher tests' model and rows (``tests.teacher.conftest``): a tiny Moonlight, 12 conversations."""
    tmp = tmp_path_factory.mktemp("shards")
    return save_tiny("moonlight"), write_jsonl(conversations(12, seed=5), tmp / "train.jsonl"), None, tmp


def routes_cmd(setup, out, *more) -> list[str]:
    model, data, _, _ = setup
    return ["routes", "--model", str(model), "--data-jsonl", str(data), "--max-seq-len", str(MAX_LEN), "--out",
            str(out), "--with-probs", "softmax", "--top-m", "4", *more]  # fmt: skip


def test_shards_are_the_single_file_to_every_reader_and_a_killed_run_resumes(setup, tmp_path, capsys, monkeypatch):
    model, data, _, _ = setup
    single, sharded = tmp_path / "single.safetensors", tmp_path / "sharded"
    assert main(routes_cmd(setup, single)) == 0
    # killed after its first shard: the finished one stays in sharded.partial/, the rerun computes the other two
    saved, calls = hf_routes._save, []

    def killed(path, *args):
        if calls:
            raise KeyboardInterrupt
        calls.append(path.name)
        saved(path, *args)

    monkeypatch.setattr(hf_routes, "_save", killed)
    with pytest.raises(KeyboardInterrupt):
        main(routes_cmd(setup, sharded, "--chunk-rows", "5"))
    assert [p.name for p in (tmp_path / "sharded.partial").glob("rows-*")] == calls and not sharded.exists()
    resumed = []
    monkeypatch.setattr(hf_routes, "_save", lambda path, *args: (resumed.append(path.name), saved(path, *args)))
    assert main(routes_cmd(setup, sharded, "--chunk-rows", "5")) == 0
    assert "in shards of 5 rows" in capsys.readouterr().out
    assert sorted(resumed) == [
        "rows-000000000005-000000000010.safetensors",
        "rows-000000000010-000000000012.safetensors",
    ]
    assert not (tmp_path / "sharded.partial").exists()
    monkeypatch.setattr(hf_routes, "_save", saved)
    assert main(routes_cmd(setup, tmp_path / "whole", "--chunk-rows", "5")) == 0  # never killed
    files = sorted(p.name for p in sharded.iterdir())
    assert files == sorted(p.name for p in (tmp_path / "whole").iterdir()) and len(files) == 4
    assert all((sharded / f).read_bytes() == (tmp_path / "whole" / f).read_bytes() for f in files)
    index = json.loads((sharded / INDEX).read_text())
    assert [s["rows"] for s in index["shards"]] == [[0, 5], [5, 10], [10, 12]]
    one, shards = open_routes(single), open_routes(sharded)
    assert isinstance(shards, RouteShards) and shards.num_rows == one.num_rows == 12 and shards.top_m == 4
    for name in NAMES:
        assert torch.equal(one.whole(name), shards.whole(name)), name
        for row in (0, 4, 5, 11):
            assert torch.equal(one.rows_of(name, row), shards.rows_of(name, row)), (name, row)
    # the teacher: the same routes at every token of a batch; the collected prior: the same bytes
    a = prepare_run(config(setup, tmp_path / "a", "routing-kd", "anchor.base=routes", f"anchor.routes={single}"))
    b = prepare_run(config(setup, tmp_path / "b", "routing-kd", "anchor.base=routes", f"anchor.routes={sharded}"))
    sample_BS = torch.tensor([[4, 4, 4, 5, 5, -1], [11, 11, 11, 11, 0, 0]])
    steps = (a.handle.teacher.step(sample_BS).__dict__, b.handle.teacher.step(sample_BS).__dict__)
    for x, y in zip(*(s.values() for s in steps), strict=True):
        assert (x is None and y is None) or torch.equal(x, y)
    priors = [collect_from_routes(str(model), data, r, tmp_path / f"{r.stem}.prior", MAX_LEN, progress=False) for r in
              (single, sharded)]  # fmt: skip
    assert torch.equal(priors[0].prior_qa, priors[1].prior_qa)


def test_a_broken_shard_directory_is_refused_naming_each_problem(setup, tmp_path):
    sharded = tmp_path / "sharded"
    assert main(routes_cmd(setup, sharded, "--chunk-rows", "5")) == 0
    index = json.loads((sharded / INDEX).read_text())
    index["shards"] = [index["shards"][0], index["shards"][2]]  # rows 5..10 left out
    index["metadata"]["routers_sha256"] = "f" * 64
    (sharded / INDEX).write_text(json.dumps(index))
    with pytest.raises(RouteFileError) as err:
        open_routes(sharded)
    text = str(err.value)
    assert "holds rows 10..12, the next rows are 5.." in text and "its routers_sha256 differ from the index's" in text
    (sharded / INDEX).unlink()
    with pytest.raises(RouteFileError, match=r"a directory without a readable index\.json"):
        open_routes(sharded)
