"""``rpb validate``: a good prior passes; each kind of mismatch or damage is named."""

import json
import math
import shutil

import pytest
import torch
from safetensors.torch import load_file, save_file

from rpb.cli import main
from rpb.collect import collect
from rpb.prior.artifact import METADATA_KEY, read_metadata
from rpb.train.validate import validate_artifact
from tests.conftest import qa, write_rows

ROWS = [qa(f"What is {i} + {i}?", f"{2 * i}") for i in range(6)]


@pytest.fixture(scope="module")
def collected(tmp_path_factory, save_tiny):
    tmp = tmp_path_factory.mktemp("validate")
    data = write_rows(tmp / "data.jsonl", ROWS)
    out = tmp / "prior.safetensors"
    collect(str(save_tiny("moonlight")), data, out, top_k=2, max_seq_len=256, progress=False)
    return out, data


def rewrite(src, dst, tensors=None, meta=None):
    """Copy an artifact with some tensors or metadata fields replaced (to damage it on purpose)."""
    t = load_file(src)
    t.update(tensors or {})
    m = read_metadata(src)
    m.update(meta or {})
    save_file(t, dst, metadata={METADATA_KEY: json.dumps(m)})
    return dst


def test_good_prior_passes_with_summary(collected, save_tiny, capsys):
    out, data = collected
    code = main(
        [
            "validate",
            str(out),
            "--data-jsonl",
            str(data),
            "--expected-model",
            str(save_tiny("moonlight")),
            "--expected-layers",
            "2",
            "--expected-experts",
            "8",
        ]
    )
    text = capsys.readouterr().out
    assert code == 0 and "OK" in text and "samples 6" in text
    # entropy of the mean Q prior of the first MoE layer, computed here by hand
    prior = load_file(out)["prior_qa"].double()
    mean = prior[:, 0, 0].mean(dim=0)
    mean = mean / mean.sum()
    entropy = -sum(float(p) * math.log2(float(p)) for p in mean)
    assert f"layer   1: {entropy:.3f}" in text


def test_edited_row_is_caught(collected, tmp_path):
    out, data = collected
    lines = data.read_text().splitlines()
    lines[2] = lines[2].replace("2 + 2", "2 + 3")
    edited = tmp_path / "edited.jsonl"
    edited.write_text("\n".join(lines) + "\n")
    report = validate_artifact(out, data_jsonl=edited)
    assert not report.ok
    assert any("sha256" in p for p in report.problems)
    assert any("edited" in p and "[3]" in p for p in report.problems)


def test_reordered_rows_are_caught(collected, tmp_path):
    out, data = collected
    lines = data.read_text().splitlines()
    lines[0], lines[1] = lines[1], lines[0]
    swapped = tmp_path / "swapped.jsonl"
    swapped.write_text("\n".join(lines) + "\n")
    problems = validate_artifact(out, data_jsonl=swapped).problems
    assert any("reordered" in p and "line 1 was line 2" in p for p in problems)
    assert not any("rows, the prior has" in p for p in problems)  # the count still matches


def test_different_row_count_is_caught(collected, tmp_path):
    out, data = collected
    longer = tmp_path / "longer.jsonl"
    longer.write_text(data.read_text() + json.dumps(qa("extra", "row")) + "\n")
    problems = validate_artifact(out, data_jsonl=longer).problems
    assert any("has 7 rows, the prior has 6" in p for p in problems)


def test_prior_from_another_model_is_caught(collected, save_tiny, tmp_path):
    out, _ = collected
    other = validate_artifact(out, expected_model=str(save_tiny("qwen3_moe")))
    assert any("whose routers differ" in p for p in other.problems)
    assert any(p.startswith("model: num_experts") or p.startswith("model: moe_layers") for p in other.problems) or any(
        "routers_sha256" in p for p in other.problems
    )
    # the same configuration with other weights: a config hash cannot tell them apart, the routers can
    same_config_other_weights = validate_artifact(out, expected_model=str(save_tiny("moonlight", seed=1)))
    assert [p.split(":")[1].strip() for p in same_config_other_weights.problems] == ["the prior was collected on "
        f"{str(save_tiny('moonlight'))!r}, whose routers differ from {str(save_tiny('moonlight', seed=1))!r}'s",
        "routers_sha256"]  # fmt: skip
    # the very checkpoint, moved: the same routers
    moved = tmp_path / "moved"
    shutil.copytree(save_tiny("moonlight"), moved)
    assert validate_artifact(out, expected_model=str(moved)).ok
    # a hub id that is not in the local cache: nothing is downloaded, and the problem says what to pass
    by_name = validate_artifact(out, expected_model="moonshotai/Moonlight-16B-A3B")
    assert any("neither a checkpoint directory nor in the local Hugging Face cache" in p for p in by_name.problems)


def test_shape_expectations(collected):
    out, _ = collected
    problems = validate_artifact(out, expected_layers=26, expected_experts=64).problems
    assert any("2 MoE layers, expected 26" in p for p in problems)
    assert any("8 experts, expected 64" in p for p in problems)


def test_damaged_tensors_are_all_reported(collected, tmp_path):
    out, _ = collected
    prior = load_file(out)["prior_qa"].clone()
    prior[0, 0, 0, 0] = float("nan")
    prior[1, 1, 1, 1] = -0.5
    prior[2, 0, 1] *= 2
    bad = rewrite(out, tmp_path / "bad.safetensors", {"prior_qa": prior}, {"schema_version": 99})
    problems = validate_artifact(bad).problems
    assert any("non-finite" in p for p in problems)
    assert any("negative" in p for p in problems)
    assert any("do not sum to 1" in p for p in problems)
    assert any("schema_version 99" in p for p in problems)


def test_wrong_shape_and_dtype(collected, tmp_path):
    out, _ = collected
    prior = load_file(out)["prior_qa"][:, :, :1].to(torch.float64)
    problems = validate_artifact(rewrite(out, tmp_path / "s.safetensors", {"prior_qa": prior})).problems
    assert any("dtype torch.float64" in p for p in problems) and any("shape" in p for p in problems)


def test_files_that_are_not_priors_are_refused_without_unpickling(tmp_path):
    import pickle

    class Boom:
        def __reduce__(self):
            return (exec, ("raise SystemExit('unpickled!')",))

    evil = tmp_path / "prior.pt"
    evil.write_bytes(pickle.dumps(Boom()))
    report = validate_artifact(evil)
    assert not report.ok and "not a readable safetensors file" in report.problems[0]
    plain = tmp_path / "plain.safetensors"
    save_file({"x": torch.zeros(2)}, plain)
    assert "not an rpb prior artifact" in validate_artifact(plain).problems[0]
