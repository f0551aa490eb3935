"""rpb's route file: what is saved is read back as it was, and a file that is not one is refused naming why."""

from __future__ import annotations

import json

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
    assert rf.metadata == {"schema": "rpb_routes", "schema_version": 1, "engine": "vllm", "routers_sha256": "a" * 64,
                           "model": None, "data_sha256": None}  # fmt: skip


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
    assert "3 problem(s)" in text and "schema_version 7" in text and "routes: torch.int64" in text
    assert "token_offsets: not a non-decreasing run from 0 to 2" in text
    save_file(tensors, str(tmp_path / "plain.safetensors"))
    with pytest.raises(RouteFileError, match="not an rpb route file"):
        load_routes(tmp_path / "plain.safetensors")
    (tmp_path / "junk.safetensors").write_bytes(b"junk")
    with pytest.raises(RouteFileError, match="not a readable safetensors file"):
        load_routes(tmp_path / "junk.safetensors")
