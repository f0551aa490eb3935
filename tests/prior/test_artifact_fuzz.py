"""Property tests of the prior artifact reader: a corrupted file (header bytes, truncation, tampered
metadata, tensors of another shape or dtype, NaN / inf, rows that do not sum) is reported by
``rpb validate`` as problems and refused by ``load_artifact`` or ``load_prior`` with ``ArtifactError`` -- never a
traceback; ``load_prior`` (what every command reads a prior with) refuses exactly the files ``validate`` faults."""

from __future__ import annotations

import hashlib
import json
import struct
import tempfile
from pathlib import Path

import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from rpb.prior.artifact import REQUIRED_METADATA, SCHEMA, SCHEMA_VERSION, ArtifactError, PriorArtifact, load_artifact
from rpb.prior.artifact import save_artifact as save
from rpb.prior.checks import ROW_SUM_TOLERANCE, load_prior
from rpb.train.validate import validate_artifact

FUZZ = settings(max_examples=200, derandomize=True, deadline=None, suppress_health_check=[HealthCheck.too_slow])
N, L, E = 3, 2, 4


def _metadata() -> dict:
    meta = {
        "schema": SCHEMA, "schema_version": SCHEMA_VERSION, "rpb_version": "0", "model": "m",
        "model_type": "qwen3_moe", "model_config_sha256": "c" * 64, "routers_sha256": "r" * 64, "tokenizer": "t",
        "chat_template_sha256": "h" * 64, "chat_template_kwargs": {}, "chat_template_date": None,
        "reasoning": {"turns": 0, "dropped_turns": 0, "rows_dropped": 0}, "router_transform": "softmax",
        "prior_kind": "probability",
        "top_k": 2, "max_seq_len": 64, "routed_positions": "all-positions-of-truncated-sequence",
        "moe_layers": [1, 2], "num_experts": E, "num_rows": N, "data_sha256": "d" * 64, "spans": ["Q", "A"],
    }  # fmt: skip
    assert set(meta) == set(REQUIRED_METADATA) | {"prior_kind"}
    return meta


def _tensors() -> dict[str, torch.Tensor]:
    prior = torch.softmax(torch.randn(N, 2, L, E, generator=torch.Generator().manual_seed(0)), dim=-1)
    return {"prior_qa": prior, "span_tokens": torch.full((N, 2), 3, dtype=torch.int64),
            "row_sha256": torch.zeros(N, 32, dtype=torch.uint8)}  # fmt: skip


def _save(tensors, meta) -> Path:
    path = Path(tempfile.mkdtemp()) / "prior.safetensors"
    save(PriorArtifact(metadata=meta, **tensors), path)
    return path


VALID = _save(_tensors(), _metadata()).read_bytes()
json_values = st.none() | st.booleans() | st.integers() | st.floats() | st.text(max_size=8) | st.lists(st.integers())


@st.composite
def corrupted(draw) -> Path:
    kind = draw(st.sampled_from(["flip", "truncate", "metadata", "tensor"]))
    if kind in ("flip", "truncate"):
        data = bytearray(VALID)
        if kind == "flip":
            for _ in range(draw(st.integers(1, 4))):
                # mostly the header (8-byte length + JSON), where a flip changes what the file says it holds
                pos = draw(st.integers(0, min(len(data) - 1, draw(st.sampled_from([16, 400, len(data)])))))
                data[pos] ^= draw(st.integers(1, 255))
        else:
            data = data[: draw(st.integers(0, len(data) - 1))]
        path = Path(tempfile.mkdtemp()) / "prior.safetensors"
        path.write_bytes(bytes(data))
        return path
    meta, tensors = _metadata(), _tensors()
    if kind == "metadata":
        key = draw(st.sampled_from(sorted(REQUIRED_METADATA)))
        if draw(st.booleans()):
            del meta[key]
        else:
            meta[key] = draw(json_values)
        return _save(tensors, meta)
    name = draw(st.sampled_from(sorted(tensors)))
    how = draw(st.sampled_from(["nan", "inf", "negative", "scaled", "shape", "dtype"]))
    t = tensors[name]
    if how in ("nan", "inf", "negative", "scaled"):
        t = t.double() if name == "prior_qa" else t
        flat = t.reshape(-1)
        i = draw(st.integers(0, flat.numel() - 1))
        if name == "prior_qa":
            flat[i] = {"nan": float("nan"), "inf": float("inf"), "negative": -0.25, "scaled": flat[i] * 1.5}[how]
            t = t.float()
        else:
            flat[i] = 0
    elif how == "shape":
        t = t.reshape(-1)[: draw(st.integers(0, t.numel() - 1))]
    else:
        t = t.to(draw(st.sampled_from([torch.float16, torch.float64, torch.int32, torch.uint8])))
    tensors[name] = t
    return _save(tensors, meta)


@FUZZ
@given(corrupted())
def test_a_corrupted_artifact_is_reported_never_a_traceback(path):
    report = validate_artifact(path)  # never raises
    try:
        checked = load_prior(path)
    except ArtifactError as e:
        assert str(path) in str(e) and not report.ok
        assert all(p in str(e) for p in report.problems)  # validate's messages, every one
    else:
        assert report.ok and checked.metadata == load_artifact(path).metadata
    try:
        art = load_artifact(path)
    except ArtifactError as e:
        assert str(path) in str(e)
        assert not report.ok
        return
    if report.ok:  # only an artifact that holds together passes
        assert torch.isfinite(art.prior_qa).all() and (art.prior_qa >= 0).all()
        assert ((art.prior_qa.double().sum(-1) - 1).abs() <= ROW_SUM_TOLERANCE).all()
        assert tuple(art.prior_qa.shape) == (N, 2, L, E) and art.prior_qa.dtype == torch.float32


def test_the_untouched_artifact_validates():
    path = Path(tempfile.mkdtemp()) / "prior.safetensors"
    path.write_bytes(VALID)
    assert validate_artifact(path).ok
    (header_len,) = struct.unpack("<Q", VALID[:8])
    # the hash of every byte after the header, computed here from the file itself
    tensors_sha256 = hashlib.sha256(VALID[8 + header_len :]).hexdigest()
    meta = json.loads(json.loads(VALID[8 : 8 + header_len])["__metadata__"]["rpb"])
    assert meta == {**_metadata(), "tensors_sha256": tensors_sha256}
    assert load_prior(path).metadata == meta
