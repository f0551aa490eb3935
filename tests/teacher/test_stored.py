"""routing-kd from stored routes through ``rpb train`` on a tiny DeepSeek-V3 (Moonlight) model: it trains, and a route
file of another model, data file or labelling is refused naming each, by the run and by its dry run."""

from __future__ import annotations

import json

import pytest
from safetensors import safe_open
from safetensors.torch import load_file, save_file

from rpb.collect.hf_routes import write_routes
from rpb.errors import ArgumentError, ConfigError
from rpb.replay.routefile import ROUTES_KEY
from rpb.testing.data import conversations, write_jsonl
from rpb.train.run import prepare_run, run_training
from tests.teacher.conftest import MAX_LEN, config, log_of

pytestmark = pytest.mark.usefixtures("one_thread")


def test_stored_routes_train_and_what_they_cannot_serve_is_refused(setup, tmp_path):
    _, _, routes, tmp = setup
    out = run_training(config(setup, tmp_path / "stored", "routing-kd", "anchor.base=routes",
                              f"anchor.routes={routes}"), progress=False)  # fmt: skip
    record = json.loads((out / "rpb_run.json").read_text())["base"]
    assert record["source"] == "routes" and record["with_probs"]
    terms = [r["anchor_loss"] for r in log_of(out) if "anchor_loss" in r]
    # the default with probabilities, the bucket, is 0 on the base itself (step 1) and not once the model moved;
    # the top-k KL, by name, is not 0 there: q renormalised over the k against the whole p (its value there is
    # -log of the base's mass on its own top-k; tests/teacher/test_routing_kd_matrix.py reads both by hand)
    assert len(terms) == 3 and terms[0] == pytest.approx(0.0, abs=1e-6) and 0 < terms[-1] < 10
    assert record["routes_loss"] == "bucket"
    # a version-1 file (the `hold` grid's, before --top-m) is the same routes: the same bucket terms, step by step
    tensors, meta = load_file(routes), json.loads(safe_open(str(routes), "pt").metadata()[ROUTES_KEY])
    save_file(tensors, str(tmp / "v1.safetensors"), metadata={ROUTES_KEY: json.dumps({**meta, "schema_version": 1})})
    out = run_training(config(setup, tmp_path / "v1", "routing-kd", "anchor.base=routes",
                              f"anchor.routes={tmp / 'v1.safetensors'}"), progress=False)  # fmt: skip
    assert [r["anchor_loss"] for r in log_of(out) if "anchor_loss" in r] == terms
    ids_alone = tmp / "ids.safetensors"
    write_routes(str(setup[0]), setup[1], ids_alone, MAX_LEN)
    with pytest.raises(ArgumentError, match=r"anchor.routes_loss=bucket reads the base's probabilities"):
        prepare_run(config(setup, tmp_path / "x", "routing-kd", "anchor.base=routes", f"anchor.routes={ids_alone}",
                           "anchor.routes_loss=bucket"))  # fmt: skip
    with pytest.raises(ConfigError, match=r"anchor.routes_loss: one of bucket, hinge, topk-kl, set-ce"):
        config(setup, tmp_path / "x", "routing-kd", "anchor.base=routes", f"anchor.routes={routes}",
               "anchor.routes_loss=margin")  # fmt: skip
    with pytest.raises(ConfigError, match=r"anchor.routes_loss: the form of routing-kd's term from stored routes"):
        config(setup, tmp_path / "x", "routing-kd", "anchor.routes_loss=bucket")
    with pytest.raises(ConfigError, match=r"output-kd needs the base's next-token distribution"):
        config(setup, tmp_path / "x", "output-kd", "anchor.base=routes", f"anchor.routes={routes}")
    extra = write_jsonl(conversations(3, seed=9), tmp / "extra.jsonl")
    with pytest.raises(ConfigError, match=r"data.mix: anchor.base=routes"):
        config(setup, tmp_path / "x", "routing-kd", "anchor.base=routes", f"anchor.routes={routes}",
               f'data.mix=[{{"path": "{extra}", "share": 0.25}}]')  # fmt: skip
    with pytest.raises(ConfigError, match=r"anchor.routes: required by anchor.base=routes"):
        config(setup, tmp_path / "x", "routing-kd", "anchor.base=routes")
    with pytest.raises(
        ConfigError, match=r"anchor.routes: read only by the methods with a base \(routing-kd, output-kd"
    ):
        config(setup, tmp_path / "x", "kl-to-base", f"anchor.routes={routes}")


def test_a_route_file_of_another_model_file_or_labelling_is_refused_naming_each(setup, tmp_path, save_tiny):
    model, data, routes, _tmp = setup
    other_model = tmp_path / "other.safetensors"
    write_routes(str(save_tiny("moonlight", seed=1)), data, other_model, MAX_LEN)
    other_data = write_jsonl(conversations(12, seed=6), tmp_path / "other.jsonl")
    other_file = tmp_path / "other-data.safetensors"
    write_routes(str(model), other_data, other_file, MAX_LEN)
    cut = tmp_path / "cut.safetensors"
    write_routes(str(model), data, cut, 100)  # rows cut at 100 tokens: not the training labelling
    cases = {
        other_model: "routes of another model: router fingerprint",
        other_file: "routes of another data file",
        cut: r"row 2 \(.*line 3\): the route file's tokens \(hf generate \(rpb routes\), vLLM layout\) are not rpb's "
        r"labelling of the row \(the file's row is 100 tokens, rpb's labelling makes \d+, the one a prefix of the "
        r"other: made at another max_seq_len than this run's\?",
    }
    for path, message in cases.items():
        cfg = config(setup, tmp_path / "r", "routing-kd", "anchor.base=routes", f"anchor.routes={path}")
        with pytest.raises(ArgumentError, match=message):
            prepare_run(cfg, progress=False)
    # probabilities read under another transform than the run's
    cfg = config(setup, tmp_path / "r", "routing-kd", "anchor.base=routes", f"anchor.routes={routes}",
                 "anchor.router_transform=sigmoid-normalized")  # fmt: skip
    with pytest.raises(ArgumentError, match=r"router probabilities read as softmax, the run reads its routers as"):
        prepare_run(cfg, progress=False)


def test_the_dry_run_checks_the_route_file_and_the_copy_without_the_model(setup, tmp_path, monkeypatch):
    import rpb.models
    from rpb.train.dryrun import DryRunError, dry_run

    model, data, routes, _tmp = setup
    monkeypatch.setattr(rpb.models, "load_causal_lm", lambda *a, **k: pytest.fail("the dry run loaded the model"))
    common = [f"model={model}", f"data_jsonl={data}", f"output_dir={tmp_path}", "anchor.method=routing-kd",
              "anchor.lambda=1", "anchor.router_transform=softmax", f"train.max_seq_len={MAX_LEN}"]  # fmt: skip
    ok = dry_run(None, [*common, "anchor.base=routes", f"anchor.routes={routes}"])
    assert "every row's tokens and routes match" in ok.summary()
    assert "a frozen copy" in dry_run(None, common).summary()
    cut = tmp_path / "cut.safetensors"
    write_routes(str(model), data, cut, 100)
    with pytest.raises(DryRunError) as err:
        dry_run(None, [*common, "anchor.base=routes", f"anchor.routes={cut}", "anchor.base_dtype=float8"])
    text = str(err.value)
    assert "row 2 (" in text and "the file's row is 100 tokens" in text and "another max_seq_len" in text
    assert "anchor.base_dtype: the frozen copy's dtype, read only with anchor.base=online" in text
    with pytest.raises(DryRunError, match=r"anchor.base_dtype: one of"):
        dry_run(None, [*common, "anchor.base_dtype=float8"])


def test_a_resumed_run_pins_the_route_files_contents_and_older_checkpoints_still_resume(setup, tmp_path):
    """The checkpoint record holds a route file by its sha256 (it may move, its routes may not change), and leaves
    the base's fields out for a method that reads no base, as checkpoints written before them did."""
    import shutil

    from rpb.data import file_sha256
    from rpb.train.checkpoints import run_record

    _, _, routes, _ = setup
    cfg = config(setup, tmp_path / "a", "routing-kd", "anchor.base=routes", f"anchor.routes={routes}")
    moved = tmp_path / "moved.safetensors"
    shutil.copyfile(routes, moved)
    cfg_moved = config(setup, tmp_path / "a", "routing-kd", "anchor.base=routes", f"anchor.routes={moved}")
    pinned = run_record(cfg, base_routers_sha256="r", data_sha256="d", prior_sha256=None)["method"]
    assert pinned["routes"] == file_sha256(routes)
    assert run_record(cfg_moved, base_routers_sha256="r", data_sha256="d", prior_sha256=None)["method"] == pinned
    plain = config(setup, tmp_path / "b", "kl-to-base")
    assert not {"base", "routes", "base_dtype"} & set(run_record(plain, base_routers_sha256="r", data_sha256="d",
                                                                 prior_sha256=None)["method"])  # fmt: skip
    # a checkpoint written while ids alone defaulted to set-ce recorded the defaults as one string: with a file of
    # probabilities it meant the bucket, today's default, and resumes; with ids alone it meant set-ce, not today's
    # hinge, and is refused naming both
    from rpb.train.checkpoints import MARKER, ROUTES_DEFAULT_BEFORE_HINGE, ResumeError, resolve_resume

    assert pinned["routes_loss"] == "default: bucket"
    ids_alone = tmp_path / "ids.safetensors"
    write_routes(str(setup[0]), setup[1], ids_alone, MAX_LEN)
    cfg_ids = config(setup, tmp_path / "c", "routing-kd", "anchor.base=routes", f"anchor.routes={ids_alone}")
    for cfg_now, resumes in ((cfg, True), (cfg_ids, False)):
        record = run_record(cfg_now, base_routers_sha256="r", data_sha256="d", prior_sha256=None)
        old = tmp_path / f"old-{resumes}" / "checkpoint-1"
        old.mkdir(parents=True)
        saved = {**record, "method": {**record["method"], "routes_loss": ROUTES_DEFAULT_BEFORE_HINGE}}
        (old / MARKER).write_text(json.dumps({"step": 1, **saved}))
        if resumes:
            assert resolve_resume(old.parent, str(old), record) == str(old)
        else:
            with pytest.raises(ResumeError, match=r"method.routes_loss: the checkpoint's run has 'default: set-ce', "
                               r"this run has 'default: hinge'"):  # fmt: skip
                resolve_resume(old.parent, str(old), record)
