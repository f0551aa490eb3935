"""rpb's route file: what is saved is read back as it was, and a file that is not one is refused naming why."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch
from safetensors.torch import load_file, save_file

from rpb.replay.routefile import ROUTES_KEY, RouteFileError, load_routes, save_routes


def test_rows_are_read_back_as_saved(tmp_path):
    routes = [np.array([[[0, 0], [3, 1]], [[0, 0], [2, 5]]], np.uint8), np.array([[[0, 0], [7, 6]]], np.uint16)]
    tokens = [[11, 12], [13]]
    save_routes(tmp_path / "r.safetensors", tokens, routes, engine="vllm", routers_sha256="a" * 64)
    rf = load_routes(tmp_path / "r.safetensors")
    assert rf.num_rows == 2 and rf.routes_RXK.dtype == torch.int16
    assert rf.tokens(0) == [11, 12] and rf.tokens(1) == [13]
    assert rf.routes(0).tolist() == routes[0].tolist() and rf.routes(1).tolist() == routes[1].tolist()
    assert rf.metadata == {"schema": "rpb_routes", "schema_version": 2, "engine": "vllm", "routers_sha256": "a" * 64,
                           "model": None, "data_sha256": None}  # fmt: skip
    assert rf.probs_RXK is None and rf.extra_ids_RXJ is None and rf.top_m == 2


def test_the_experts_stored_beyond_the_top_k_are_read_back_and_checked(tmp_path):
    routes = [np.array([[[3, 1]], [[2, 5]]], np.uint8), np.array([[[7, 6]]], np.uint8)]
    probs = [np.array([[[0.5, 0.2]], [[0.4, 0.3]]]), np.array([[[0.6, 0.1]]])]
    extra_ids = [np.array([[[0, 2, 4]], [[1, 0, 7]]]), np.array([[[5, 4, 3]]])]
    extra_probs = [np.array([[[0.1, 0.05, 0.05]], [[0.1, 0.1, 0.05]]]), np.array([[[0.1, 0.1, 0.05]]])]
    path = tmp_path / "m.safetensors"
    save_routes(path, [[1, 2], [3]], routes, engine="e", probs=probs, probs_transform="softmax",
                extra=(extra_ids, extra_probs))  # fmt: skip
    rf = load_routes(path)
    assert rf.top_m == 5 and rf.metadata["top_m"] == 5 and rf.metadata["schema_version"] == 2
    ids, p = rf.extra(1)
    assert ids.dtype == torch.int16 and ids.tolist() == [[[5, 4, 3]]]
    assert p.dtype == torch.float32 and p.flatten().tolist() == pytest.approx([0.1, 0.1, 0.05])
    with pytest.raises(RouteFileError, match="extra experts without the probabilities"):
        save_routes(tmp_path / "x", [[1, 2], [3]], routes, engine="e", extra=(extra_ids, extra_probs))
    with pytest.raises(RouteFileError, match="do not have the routes'"):
        save_routes(tmp_path / "x", [[1, 2], [3]], routes, engine="e", probs=probs, probs_transform="softmax",
                    extra=(extra_ids[::-1], extra_probs[::-1]))  # fmt: skip
    assert not (tmp_path / "x").exists()
    # a file whose extra tensors disagree with its metadata, or that claims version 1, is refused naming each
    tensors = load_file(path)
    meta = {"schema": "rpb_routes", "schema_version": 2, "top_m": 4, "probs_transform": "softmax"}
    save_file(tensors, str(tmp_path / "bad.safetensors"), metadata={ROUTES_KEY: json.dumps(meta)})
    with pytest.raises(RouteFileError, match="top_m 4, the file stores 5"):
        load_routes(tmp_path / "bad.safetensors")
    meta["schema_version"] = 1
    save_file(tensors, str(tmp_path / "v1.safetensors"), metadata={ROUTES_KEY: json.dumps(meta)})
    with pytest.raises(RouteFileError, match="in a version-1 file"):
        load_routes(tmp_path / "v1.safetensors")
    del tensors["extra_probs"]
    meta["schema_version"] = 2
    save_file(tensors, str(tmp_path / "half.safetensors"), metadata={ROUTES_KEY: json.dumps(meta)})
    with pytest.raises(RouteFileError, match="extra_ids and extra_probs go together"):
        load_routes(tmp_path / "half.safetensors")


def test_what_cannot_be_saved_is_refused(tmp_path):
    with pytest.raises(RouteFileError, match="rows disagree on"):
        save_routes(tmp_path / "x", [[1], [2]], [np.zeros((1, 2, 2), int), np.zeros((1, 3, 2), int)], engine="e")
    with pytest.raises(RouteFileError, match="1 rows of routes for 2 rows"):
        save_routes(tmp_path / "x", [[1], [2]], [np.zeros((1, 2, 2), int)], engine="e")
    with pytest.raises(RouteFileError, match="does not fit the file's int16"):
        save_routes(tmp_path / "x", [[1]], [np.full((1, 2, 2), 40000, np.int64)], engine="e")
    with pytest.raises(RouteFileError, match="not integer"):
        save_routes(tmp_path / "x", [[1]], [np.zeros((1, 2, 2), float)], engine="e")
    assert not (tmp_path / "x").exists()


def test_a_broken_file_is_refused_with_every_problem(tmp_path):
    save_routes(tmp_path / "r.safetensors", [[1, 2]], [np.zeros((2, 3, 2), np.int16)], engine="e")
    tensors = load_file(tmp_path / "r.safetensors")
    meta = {"schema": "rpb_routes", "schema_version": 7}
    tensors["token_offsets"] = torch.tensor([0, 5])
    tensors["routes"] = tensors["routes"].long()
    save_file(tensors, str(tmp_path / "bad.safetensors"), metadata={ROUTES_KEY: json.dumps(meta)})
    with pytest.raises(RouteFileError) as err:
        load_routes(tmp_path / "bad.safetensors")
    text = str(err.value)
    assert (
        "3 problem(s)" in text and "schema_version 7, expected one of (1, 2)" in text and "routes: torch.int64" in text
    )
    assert "token_offsets: not a non-decreasing run from 0 to 2" in text
    save_file(tensors, str(tmp_path / "plain.safetensors"))
    with pytest.raises(RouteFileError, match="not an rpb route file"):
        load_routes(tmp_path / "plain.safetensors")
    whole = (tmp_path / "r.safetensors").read_bytes()
    (tmp_path / "cut.safetensors").write_bytes(whole[: len(whole) - 3])  # a copy cut short
    with pytest.raises(RouteFileError, match=r"not a readable safetensors file \(tensor '\w+': bytes"):
        load_routes(tmp_path / "cut.safetensors")
    (tmp_path / "junk.safetensors").write_bytes(b"junk")
    with pytest.raises(RouteFileError, match="not a readable safetensors file"):
        load_routes(tmp_path / "junk.safetensors")


def test_the_bytes_per_token_table_is_the_hand_product_at_each_shape():
    from rpb.replay.routefile import STORED_FORMS, bytes_per_token
    from rpb.testing.replicas import published, routing_part

    # Moonlight-16B-A3B: 27 decoder layers (the first dense), 64 experts, top-6; an int64 token id and, per layer,
    # int16 ids (+ float32 probabilities) of k, k, 2k and all 64 experts
    assert [bytes_per_token(27, 6, 64, f) for f in STORED_FORMS] == [
        8 + 27 * 6 * 2, 8 + 27 * 6 * (2 + 4), 8 + 27 * 12 * (2 + 4), 8 + 27 * 64 * (2 + 4)]  # fmt: skip
    assert bytes_per_token(24, 4, 6, "top-2k with probabilities") == 8 + 24 * 6 * 6  # 2k capped at the experts
    shapes = {"Moonlight-16B-A3B": (27, 64, 6)}
    for name in ("deepseek_v3", "qwen3_30b_a3b", "gpt_oss_20b", "kimi_k2"):
        c = routing_part(published(name))
        E = c.get("n_routed_experts") or c.get("num_experts") or c.get("num_local_experts")
        shapes[f"`{name}`"] = (c["num_hidden_layers"], E, c["num_experts_per_tok"])
    assert shapes["`deepseek_v3`"] == (61, 256, 8) and shapes["`gpt_oss_20b`"] == (24, 32, 4)
    docs = (Path(__file__).parents[2] / "docs" / "collect.md").read_text()
    for name, (X, E, k) in shapes.items():
        cells = [f"{b:,} B ({b * 1e8 / 1e9:,.0f} GB)" for b in (bytes_per_token(X, k, E, f) for f in STORED_FORMS)]
        row = f"| {name} | {X}, {E}, {k} | " + " | ".join(cells) + " |"
        assert row in docs, f"docs/collect.md's bytes-per-token table lacks: {row}"
