"""A damaged prior is refused by every command that reads one, with ``rpb validate``'s message, before any
model loads: a NaN, a negative value (its row still summing to 1), and one flipped bit of the tensor bytes
that keeps every value plausible (caught by ``tensors_sha256`` alone). A schema-2 prior, which has no hash,
loads with a note.

The damaged files are made once from one collected prior; each is damaged in one way only, found here by
hand (the place of the NaN, the bit flipped in the file's bytes), so each check is shown on its own.
"""

from __future__ import annotations

import hashlib
import importlib.util
import json
import logging
import struct
import sys
import types
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

import rpb.calibrate.agreement
import rpb.calibrate.run
import rpb.models
import rpb.train.run
from rpb.anchors import AnchorConfig
from rpb.cli import main
from rpb.collect import collect
from rpb.integrations.axolotl.config import AxolotlRun, AxolotlSection
from rpb.integrations.megatron.config import load_megatron_config
from rpb.prior.artifact import METADATA_KEY, ArtifactError, load_artifact, read_metadata, save_artifact
from rpb.prior.checks import ROW_SUM_TOLERANCE, load_prior, value_problems
from rpb.train.validate import validate_artifact
from tests.conftest import qa, write_rows

MEGATRON_CONFIG = Path(__file__).resolve().parents[2] / "examples" / "moonlight" / "config.yaml"
ROWS = [qa(f"What is {i} + {i}?", f"{2 * i}") for i in range(4)]
#: what each damage makes validate say, first words of the message and the place found by hand
EXPECTED = {
    "nan": "prior_qa: 1 non-finite value(s), first at [sample, span, layer, expert]=[1, 0, 1, 2]",
    "negative": "prior_qa: 1 negative value(s), first at [2, 1, 0, 3]",
    "bitflip": "tensors_sha256: the tensor bytes hash to",
}
BAD = tuple(EXPECTED)


def data_section(path: Path) -> tuple[int, dict]:
    """Where a safetensors file's tensor bytes start, and its header, read from the bytes."""
    raw = path.read_bytes()
    (n,) = struct.unpack("<Q", raw[:8])
    return 8 + n, json.loads(raw[8 : 8 + n])


@pytest.fixture(scope="module")
def priors(tmp_path_factory, save_tiny):
    """{"good", "nan", "negative", "bitflip", "old"} -> prior files, with the model and data they came from."""
    tmp = tmp_path_factory.mktemp("prior_checks")
    data = write_rows(tmp / "data.jsonl", ROWS)
    model = save_tiny("qwen3_moe")
    good = tmp / "good.safetensors"
    collect(str(model), data, good, top_k=2, max_seq_len=128, progress=False)
    out = {"good": good, "model": model, "data": data, "tmp": tmp}

    nan = load_artifact(good, mmap=False)
    nan.prior_qa[1, 0, 1, 2] = float("nan")
    save_artifact(nan, out.setdefault("nan", tmp / "nan.safetensors"))  # a true hash: the values alone are bad

    negative = load_artifact(good, mmap=False)
    row = negative.prior_qa[2, 1, 0]
    row[4] += float(row[3]) + 0.25  # the row still sums to 1
    row[3] = -0.25
    save_artifact(negative, out.setdefault("negative", tmp / "negative.safetensors"))

    start, header = data_section(good)
    raw = bytearray(good.read_bytes())
    begin = header["prior_qa"]["data_offsets"][0]
    raw[start + begin + 4 * 5] ^= 1  # the lowest mantissa bit of prior_qa's 6th value: 1 ulp
    out["bitflip"] = tmp / "bitflip.safetensors"
    out["bitflip"].write_bytes(bytes(raw))

    meta = read_metadata(good)
    del meta["tensors_sha256"]
    old = tmp / "old.safetensors"
    save_file(load_file(good), str(old), metadata={METADATA_KEY: json.dumps({**meta, "schema_version": 2})})
    out["old"] = old
    return out


def test_the_damaged_priors_are_damaged_as_meant(priors):
    good = load_file(priors["good"])["prior_qa"]
    flipped = load_file(priors["bitflip"])["prior_qa"]
    # one value, one bit: finite, positive, its row within the tolerance; every other value the same
    changed = (good != flipped).nonzero().tolist()
    assert len(changed) == 1 and torch.isfinite(flipped).all() and (flipped >= 0).all()
    assert (flipped.double().sum(-1) - 1).abs().max() <= ROW_SUM_TOLERANCE
    assert value_problems(flipped) == []
    assert value_problems(load_file(priors["negative"])["prior_qa"]) == [EXPECTED["negative"]]


@pytest.mark.parametrize("bad", BAD)
def test_validate_names_each_damage(priors, bad):
    problems = validate_artifact(priors[bad]).problems
    assert len(problems) == 1 and problems[0].startswith(EXPECTED[bad])


def test_the_recorded_hash_is_the_files_own(priors):
    start, _ = data_section(priors["good"])
    meta = read_metadata(priors["good"])
    assert meta["schema_version"] == 4
    assert meta["tensors_sha256"] == hashlib.sha256(priors["good"].read_bytes()[start:]).hexdigest()
    assert validate_artifact(priors["good"]).ok


def refused_with_validates_message(bad: str, path: Path, text: str) -> None:
    assert str(path) in text and EXPECTED[bad] in text
    for problem in validate_artifact(path).problems:
        assert problem in text


def no_model_loads(monkeypatch):
    def load(*args, **kwargs):
        raise AssertionError("a model was loaded before the prior was checked")

    for module in (rpb.train.run, rpb.calibrate.run, rpb.calibrate.agreement):
        name = "load_causal_lm" if module is rpb.train.run else "load_base_model"
        monkeypatch.setattr(module, name, load)
    monkeypatch.setattr(rpb.models, "load_tokenizer", load)  # the Megatron bridge imports it when it runs


class Untouched:
    """A model that fails the test when anything of it is read."""

    def __getattr__(self, name):
        raise AssertionError(f"the model's {name!r} was read before the prior was checked")


# ---- each command ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize("bad", BAD)
def test_train_refuses(priors, bad, tmp_path, monkeypatch, capsys):
    no_model_loads(monkeypatch)
    argv = ["train", f"model={priors['model']}", f"data_jsonl={priors['data']}", f"prior={priors[bad]}",
            f"output_dir={tmp_path / 'run'}", "anchor.method=rpb", "train.max_steps=1", "--no-progress"]  # fmt: skip
    assert main(argv) == 2
    refused_with_validates_message(bad, priors[bad], capsys.readouterr().err)
    assert not (tmp_path / "run").exists()


@pytest.mark.parametrize("bad", BAD)
def test_calibrate_refuses(priors, bad, tmp_path, monkeypatch, capsys):
    no_model_loads(monkeypatch)
    argv = ["calibrate", "--model", str(priors["model"]), "--prior", str(priors[bad]), "--data-jsonl",
            str(priors["data"]), "--out", str(tmp_path / "cal"), "--no-progress"]  # fmt: skip
    assert main(argv) == 2
    refused_with_validates_message(bad, priors[bad], capsys.readouterr().err)
    # the mechanism figures after training read the prior too
    with pytest.raises(ArtifactError) as err:
        rpb.calibrate.agreement.training_rows_agreement(priors["model"], priors["model"], priors[bad], priors["data"])
    refused_with_validates_message(bad, priors[bad], str(err.value))


@pytest.mark.parametrize("bad", BAD)
def test_experts_refuses(priors, bad, tmp_path, capsys):
    out = tmp_path / "experts.json"
    assert main(["experts", "--prior", str(priors[bad]), "--out", str(out), "--no-progress"]) == 2
    refused_with_validates_message(bad, priors[bad], capsys.readouterr().err)
    assert not out.exists()


def megatron_paths(priors, prior: Path) -> list[str]:
    (priors["tmp"] / "megatron" / "ckpt").mkdir(parents=True, exist_ok=True)
    return [f"model.pretrained_checkpoint={priors['tmp'] / 'megatron' / 'ckpt'}", f"data.root={priors['tmp']}",
            "data.file=data.jsonl", f"prior={prior}"]  # fmt: skip


@pytest.mark.parametrize("bad", BAD)
def test_megatron_check_files_refuses(priors, bad, capsys):
    assert main(["megatron-check", str(MEGATRON_CONFIG), "--files", *megatron_paths(priors, priors[bad])]) == 2
    refused_with_validates_message(bad, priors[bad], capsys.readouterr().err)


@pytest.mark.parametrize("bad", BAD)
def test_megatron_bridge_refuses(priors, bad, monkeypatch):
    from rpb.integrations.megatron.bridge import prepare_data

    no_model_loads(monkeypatch)
    cfg = load_megatron_config(MEGATRON_CONFIG, megatron_paths(priors, priors[bad]))
    with pytest.raises(ArtifactError) as err:
        prepare_data(cfg)
    refused_with_validates_message(bad, priors[bad], str(err.value))


@pytest.mark.parametrize("bad", BAD)
def test_trl_prepare_refuses(priors, bad, moon_tok):
    from rpb.integrations.trl import prepare

    with pytest.raises(ArtifactError) as err:
        prepare(Untouched(), moon_tok, str(priors["data"]), AnchorConfig(method="rpb"), str(priors[bad]))
    refused_with_validates_message(bad, priors[bad], str(err.value))


def plugin_with_axolotl_stubbed(monkeypatch):
    """The axolotl plugin's module with stand-ins for the axolotl names it imports (axolotl runs in its own
    environment, tests/integrations/axolotl/): the prior is read before any of them is used."""

    def never(*args, **kwargs):
        raise AssertionError("axolotl was reached before the prior was checked")

    names = {"axolotl.common.datasets": {"TrainDatasetMeta": never},
             "axolotl.core.trainers.base": {"AxolotlTrainer": type("AxolotlTrainer", (), {})},
             "axolotl.integrations.base": {"BasePlugin": type("BasePlugin", (), {})},
             "axolotl.loaders.tokenizer": {"load_tokenizer": never},
             "axolotl.utils.trainer": {"calculate_total_num_steps": never}}  # fmt: skip
    for dotted, attrs in names.items():
        parts = dotted.split(".")
        for i in range(1, len(parts) + 1):
            if ".".join(parts[:i]) not in sys.modules or i == len(parts):
                monkeypatch.setitem(sys.modules, ".".join(parts[:i]), types.ModuleType(".".join(parts[:i])))
        for attr, value in attrs.items():
            setattr(sys.modules[dotted], attr, value)
    spec = importlib.util.find_spec("rpb.integrations.axolotl.plugin")
    module = importlib.util.module_from_spec(spec)  # not registered: the real one stays axolotl's
    spec.loader.exec_module(module)
    return module


@pytest.mark.parametrize("bad", BAD)
def test_axolotl_plugin_refuses(priors, bad, monkeypatch):
    plugin = plugin_with_axolotl_stubbed(monkeypatch).RpbPlugin()
    plugin.run = AxolotlRun(AxolotlSection(prior=str(priors[bad])), str(priors["data"]), "answer")
    with pytest.raises(ArtifactError) as err:
        plugin.load_datasets(types.SimpleNamespace(sequence_len=128))
    refused_with_validates_message(bad, priors[bad], str(err.value))


# ---- a prior from before the hash ------------------------------------------------------------------------------


def test_a_schema_2_prior_loads_with_one_note(priors, tmp_path, caplog):
    old = priors["old"]
    report = validate_artifact(old)
    assert report.ok and "schema 2: no tensors_sha256, the tensor bytes are not checked" in report.format()
    with caplog.at_level(logging.WARNING, logger="rpb.prior.checks"):
        first = load_prior(old)
        load_prior(old)  # once per file
        assert main(["experts", "--prior", str(old), "--out", str(tmp_path / "experts.json"), "--no-progress"]) == 0
    notes = [r.getMessage() for r in caplog.records if "tensors_sha256" in r.getMessage()]
    assert len(notes) == 1 and str(old) in notes[0] and "schema 2" in notes[0] and "\n" not in notes[0]
    assert torch.equal(first.prior_qa, load_file(priors["good"])["prior_qa"])
    # a schema-3 prior must carry its hash
    meta = read_metadata(old)
    unhashed = tmp_path / "unhashed.safetensors"
    save_file(load_file(old), str(unhashed), metadata={METADATA_KEY: json.dumps({**meta, "schema_version": 3})})
    assert validate_artifact(unhashed).problems == ["metadata: missing field 'tensors_sha256' (schema 3)"]
    with pytest.raises(ArtifactError, match="missing field 'tensors_sha256'"):
        load_prior(unhashed)
