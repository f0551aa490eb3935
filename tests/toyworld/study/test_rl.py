"""One base of the ``rl`` grid in miniature: the start retrained and pinned by its hash, the prompts and the start's
prior, the weights chosen on validation, and each cell's retention against the base and against the start."""

import dataclasses
import hashlib
import json

import pytest
from safetensors.torch import load_file

from rpb.collect import collect
from rpb.retention.run import run_retention
from rpb.toyworld.study.rl import RETENTION_KEYS, StartChangedError
from rpb.toyworld.world.post import score

pytestmark = pytest.mark.usefixtures("one_thread")


def test_every_cell_of_the_grid_starts_from_the_recorded_start(rl_finished):
    study, results = rl_finished
    g = study.grid
    assert [(r["arm"], r["seed"]) for r in results] == [(a.label, s) for a in g.arms for s in g.seeds]
    record = study.start_record()
    weights = study.out / "start" / "model" / "model.safetensors"
    assert record["weights_sha256"] == hashlib.sha256(weights.read_bytes()).hexdigest()
    assert (record["method"], record["seed"], record["threads"]) == ("sft", 42, 1)
    assert record["scores"]["test"] == score(study.out / "start" / "model", "math_post", study.post, "test")
    for r in results:
        assert r["start_sha256"] == record["weights_sha256"] and r["base"] == 0
        assert set(r["scores"]) == {"validation", "test"} and r["id"] == r["scores"]["test"]["id"]
        assert len(r["rl"]["reward"]) == g.recipe.max_steps
        # R3 records its override rate, the other arms their flip rate (docs/rl.md): one of the two, never both
        flips = "override_rate" if r["arm"] == "grpo + R3" else "flip_rate"
        assert r["retention"][flips] == r["rl"]["summary"][flips]
        assert set(r["retention"]) == {f"{w}_{k}" for w in ("base", "start") for k in RETENTION_KEYS} | {
            flips,
            "logp_gap",
            "stale_mismatch",
        }
        assert r["retention"]["stale_mismatch"] == r["rl"]["summary"]["stale_mismatch"]
    assert not list((study.out / "runs").glob("*/*/*/model")), "no checkpoint is kept"


def test_the_prompts_are_held_out_and_the_prior_is_the_starts(rl_finished, tmp_path):
    study, _ = rl_finished

    def questions(path):
        rows = [json.loads(line)["messages"] for line in path.read_text().splitlines()]
        return [next(m["content"] for m in row if m["role"] == "user") for row in rows]

    prompts = questions(study.prompts())
    assert prompts and len(set(prompts)) == len(prompts) and not set(prompts) & set(questions(study.data("math_post")))
    again = tmp_path / "prior.safetensors"
    collect(str(study.out / "start" / "model"), study.prompts(), again, top_k=study.post.base.num_experts_per_tok,
            max_seq_len=study.grid.recipe.max_seq_len, batch_size=64, progress=False)  # fmt: skip
    ours, theirs = load_file(study.rl_prior()), load_file(again)
    assert ours.keys() == theirs.keys() and all((ours[k] == theirs[k]).all() for k in ours)
    from_base = tmp_path / "base.safetensors"
    collect(str(study.base()), study.prompts(), from_base, top_k=study.post.base.num_experts_per_tok,
            max_seq_len=study.grid.recipe.max_seq_len, batch_size=64, progress=False)  # fmt: skip
    assert any(not (ours[k] == load_file(from_base)[k]).all() for k in ours), "the prior is the start's, not the base's"


def test_the_weight_is_the_best_on_validation(rl_finished):
    study, results = rl_finished
    selection = json.loads((study.out / "selection.json").read_text())
    assert selection["part"] == "validation" and {t["weight"] for t in selection["trials"]} == {0.01, 0.1}
    for t in selection["trials"]:
        trial = json.loads((study.out / "selection" / f"lbl-{t['weight']:g}" / "result.json").read_text())
        assert (trial["id"], trial["ood"]) == (t["id"], t["ood"]) and trial["part"] == "validation"
    best = max(selection["trials"], key=lambda t: (t["id"] + t["ood"], -t["weight"]))
    assert selection["chosen"] == {"lbl": best["weight"]}
    assert all(r["anchor"] == {"lbl_coef": best["weight"]} for r in results if r["arm"] == "grpo + lbl")


def test_retention_against_the_start_and_the_base_is_rpb_retentions(rl_finished, tmp_path):
    """A cell that does not learn (learning rate 0) is its start: retention 1 / 0 against the start, and against
    the base what ``rpb retention`` gives of the start itself."""
    study, _ = rl_finished
    still = dataclasses.replace(study, grid=dataclasses.replace(
        study.grid, recipe=dataclasses.replace(study.grid.recipe, lr=0.0)))  # fmt: skip
    cell = still.cell(tmp_path / "still", "math_post", study.grid.arms[0], 42, None)
    r = cell["retention"]
    assert (r["start_topk_overlap"], r["start_tvd"], r["start_jsd"]) == (1.0, 0.0, 0.0)
    start = str(study.out / "start" / "model")
    direct = run_retention(str(study.base()), study.probe(), tmp_path / "direct", post=start, batch_size=64,
                           max_seq_len=study.post.max_seq_len, progress=False)  # fmt: skip
    for k in RETENTION_KEYS:
        assert r[f"base_{k}"] == pytest.approx(direct["mean"][k], abs=1e-9), k
    assert not (tmp_path / "still" / "model").exists() and (tmp_path / "still" / "result.json").is_file()


def test_a_start_that_trains_to_other_weights_is_refused(rl_finished, tmp_path):
    study, _ = rl_finished
    other = dataclasses.replace(study, out=tmp_path / "base0")
    (other.out / "start").mkdir(parents=True)
    record = study.start_record() | {"weights_sha256": "0" * 64}
    (other.out / "start" / "record.json").write_text(json.dumps(record))
    with pytest.raises(StartChangedError, match=r"record\.json.*0000000000"):
        other.start()


def test_a_start_cut_short_before_its_record_is_trained_again(rl_finished, tmp_path):
    study, _ = rl_finished
    other = dataclasses.replace(study, out=tmp_path / "base0")
    (other.out / "start" / "model").mkdir(parents=True)
    (other.out / "start" / "model" / "model.safetensors").write_bytes(b"cut short")
    other.start()
    assert other.start_record()["weights_sha256"] == study.start_record()["weights_sha256"]
