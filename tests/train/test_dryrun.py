"""``rpb train --dry-run``: every problem a real run would refuse that needs no model, listed at once; the
model's own facts named as unchecked; the model never loaded."""

import pytest

from rpb.cli import main
from rpb.collect import collect
from rpb.prior.artifact import load_artifact, save_artifact
from rpb.testing.models import ARCHITECTURES
from tests.conftest import qa, write_rows

SHORT = [qa("What is 1 + 1?", "2"), qa("Name a colour.", "Blue."), qa("Hi", "Hello")]
#: rendered, each is well over 128 tokens (the short ones under 80: tests/train/test_run.py counts them)
LONG = [qa("Say it often.", "again and again " * 40), qa("Count.", " ".join(str(i) for i in range(80)))]
ROWS = [SHORT[0], LONG[0], SHORT[1], LONG[1], SHORT[2]]


@pytest.fixture(scope="module")
def files(tmp_path_factory, save_tiny):
    """A tiny model, a data file with 2 of its 5 rows longer than 128 tokens, and the prior collected at 128."""
    tmp = tmp_path_factory.mktemp("dryrun")
    model = save_tiny("moonlight")
    data = write_rows(tmp / "train.jsonl", ROWS)
    prior = tmp / "prior.safetensors"
    top_k = ARCHITECTURES["moonlight"][1]["num_experts_per_tok"]
    collect(str(model), data, prior, top_k=top_k, max_seq_len=128, progress=False)
    return model, data, prior


@pytest.fixture
def no_model(monkeypatch):
    """The model loaders fail the test if anything calls them.

    rpb.train.run is imported first and patched too: a module first imported under the patch would bind the fake
    loader for the rest of the session, and a later test that loads a model would fail.
    """
    import rpb.models
    import rpb.train.run

    def fail(*args, **kwargs):
        raise AssertionError("the dry run loaded the model")

    for name in ("load_causal_lm", "load_base_model"):
        monkeypatch.setattr(rpb.models, name, fail)
    monkeypatch.setattr(rpb.train.run, "load_causal_lm", fail)


def test_a_dry_run_lists_every_bad_row_as_the_real_run_reports_it(files, tmp_path, capsys, no_model):
    model, _, _ = files
    no_answer = {"messages": [{"role": "user", "content": "q"}]}
    bad = write_rows(tmp_path / "bad.jsonl", [SHORT[0], "", "{", qa("q", ""), no_answer, SHORT[1]])
    args = ["train", f"model={model}", f"data_jsonl={bad}", f"output_dir={tmp_path / 'run'}", "anchor.method=sft",
            "train.max_seq_len=128"]  # fmt: skip
    assert main(args) == 2  # the real run: its rows are refused before the model loads
    real = [line.strip() for line in capsys.readouterr().err.splitlines() if line.strip().startswith(f"{bad}:")]
    assert [line.split(":")[1] for line in real] == ["2", "3", "4", "5"]
    assert main([*args, "--dry-run"]) == 2
    out, err = capsys.readouterr()
    assert "configuration OK" not in out and "4 problem(s) a real run would refuse" in err
    for line in real:
        assert f"- data_jsonl: {line}" in err
    assert "fingerprint" not in err  # no prior is read: no word of the prior's model fields


def test_a_dry_run_lists_the_prior_its_settings_and_the_rows_at_once(files, tmp_path, capsys, no_model):
    model, _, prior = files
    art = load_artifact(prior, mmap=False)
    art.prior_qa[1, 0, 0, 2] = float("nan")
    nan_prior = tmp_path / "nan.safetensors"
    save_artifact(art, nan_prior)  # with the hash of its own (NaN-holding) tensors: only the values are wrong
    edited = write_rows(tmp_path / "edited.jsonl", [*ROWS[:2], qa("What is 2 + 2?", ""), *ROWS[3:]])
    (tmp_path / "choice.json").write_text('{"experts": {"1": "all"}}')
    args = ["train", f"model={model}", f"data_jsonl={edited}", f"prior={nan_prior}", f"output_dir={tmp_path / 'run'}",
            "anchor.beta=-1", "data.chat_template_kwargs={enable_thinking: true}", "train.max_seq_len=100",
            f"train.only_experts={tmp_path / 'choice.json'}", "--dry-run"]  # fmt: skip
    assert main(args) == 2
    err = capsys.readouterr().err
    expected = [
        "- anchor.beta: must be >= 0, got -1.0",  # the configuration
        "- prior: prior_qa: 1 non-finite value(s), first at [sample, span, layer, expert]=[1, 0, 0, 2]",  # values
        f"- prior: data: {edited} has sha256",  # the data against the prior
        "- prior: data: 1 row(s) not in the collected data (edited?), at line(s) [3]",
        "- prior: data: 1 collected row(s) are no longer in the file",
        f"- data_jsonl: {edited}:3: empty-a-span [messages[1].content]: message 1 (assistant) is empty",  # rows
        "- prior: chat_template_kwargs: the prior has {}, this run has {'enable_thinking': True}",  # settings
        "- prior: max_seq_len: the prior has 128, this run has 100",
        "- train.only_experts: ",  # the expert config the run would read
    ]
    for line in expected:
        assert line in err, line
    assert "9 problem(s) a real run would refuse" in err
    assert "routers fingerprint, top-k, MoE layers and experts: checked" in err.splitlines()[-1]  # from the files
    assert "- prior: model" not in err and "- prior: routers_sha256" not in err


def test_a_clean_dry_run_says_what_it_checked_and_what_it_left_to_the_run(files, tmp_path, capsys, no_model):
    model, data, prior = files
    args = ["train", f"model={model}", f"data_jsonl={data}", f"prior={prior}", f"output_dir={tmp_path / 'run'}",
            "--dry-run"]  # fmt: skip
    assert main(args) == 0
    out = capsys.readouterr().out
    assert "command line: configuration OK (anchor.method=rpb)" in out
    assert "5 row(s) labelled, 2 cut to max_seq_len=128" in out  # the two rows built too long
    assert "the prior's routers fingerprint, top-k, MoE layers and experts: checked against the model's" in out
    assert not (tmp_path / "run").exists()
    args = ["train", f"model={model}", f"data_jsonl={data}", "anchor.method=sft", "train.max_seq_len=128",
            f"output_dir={tmp_path / 'run'}", "--dry-run"]  # fmt: skip
    assert main(args) == 0
    out = capsys.readouterr().out
    assert "configuration OK (anchor.method=sft)" in out and "prior" not in out  # sft reads no prior


def test_a_dry_run_refuses_a_prior_made_for_another_model(files, save_tiny, tmp_path, capsys, no_model):
    """The routers' fingerprint from the checkpoint's router tensors alone: another seed of the same architecture
    is another model, whose prior a real run would refuse; a hub id not on this machine leaves it to the run."""
    _, data, prior = files
    other = save_tiny("moonlight", seed=1)
    args = ["train", f"model={other}", f"data_jsonl={data}", f"prior={prior}", f"output_dir={tmp_path / 'run'}",
            "--dry-run"]  # fmt: skip
    assert main(args) == 2
    err = capsys.readouterr().err
    assert "- prior: model: the prior was collected on" in err and "whose routers differ from" in err
    far = ["train", "model=some-org/not-on-this-machine", "tokenizer=" + str(files[0]), f"data_jsonl={data}",
           f"prior={prior}", f"output_dir={tmp_path / 'run'}", "--dry-run"]  # fmt: skip
    main(far)
    out, err = capsys.readouterr()
    assert "not checked without the model's weights" in out + err and "routers differ" not in out + err
