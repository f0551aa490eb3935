"""Atomic writes: the final name appears only complete; a failure leaves neither file nor temporary."""

from __future__ import annotations

import json
import os
import stat

import pytest
import torch
from safetensors.torch import save_file

from rpb.fileio import atomic_path, write_json_atomic, write_text_atomic


def test_a_failed_write_leaves_the_old_content_and_no_temporary(tmp_path):
    path = write_text_atomic(tmp_path / "out.txt", "old")
    with pytest.raises(KeyboardInterrupt), atomic_path(path) as tmp:
        tmp.write_text("half of the new")
        raise KeyboardInterrupt
    assert path.read_text() == "old" and sorted(p.name for p in tmp_path.iterdir()) == ["out.txt"]


def test_files_and_directories_land_whole_with_ordinary_permissions(tmp_path):
    umask = os.umask(0o022)
    try:
        write_json_atomic(tmp_path / "a" / "b.json", {"x": [1, 2]})
        with atomic_path(tmp_path / "a" / "t.safetensors") as tmp:  # a writer that makes its file anew
            save_file({"t": torch.zeros(2)}, str(tmp))
        with atomic_path(tmp_path / "model", directory=True) as tmp:
            (tmp / "weights").write_text("w")
            assert not (tmp_path / "model").exists()
    finally:
        os.umask(umask)
    assert json.loads((tmp_path / "a" / "b.json").read_text()) == {"x": [1, 2]}
    assert (tmp_path / "model" / "weights").read_text() == "w"
    # not mkstemp's private 0600 / 0700: other processes (other users, other nodes) read them
    for written in ("b.json", "t.safetensors"):
        assert stat.S_IMODE((tmp_path / "a" / written).stat().st_mode) & 0o044 == 0o044, written
    assert sorted(p.name for p in tmp_path.iterdir()) == ["a", "model"]


def test_a_failed_directory_build_is_removed_and_the_old_one_kept(tmp_path):
    with atomic_path(tmp_path / "model", directory=True) as tmp:
        (tmp / "v").write_text("1")
    with pytest.raises(RuntimeError), atomic_path(tmp_path / "model", directory=True) as tmp:
        (tmp / "v").write_text("2")
        raise RuntimeError("pretraining failed")
    assert (tmp_path / "model" / "v").read_text() == "1" and [p.name for p in tmp_path.iterdir()] == ["model"]


@pytest.mark.parametrize("write", [write_text_atomic, lambda p, text: write_json_atomic(p, {"text": text})])
def test_a_text_write_cut_off_midway_leaves_the_old_file_whole(write, tmp_path, monkeypatch):
    """The disk fills (or the process dies) half way through the bytes: the old file is still there, whole."""
    from pathlib import Path

    path = tmp_path / "record.json"
    path.write_text("old")
    real = Path.write_text

    def half_then_fail(self, data, *args, **kwargs):
        real(self, data[: len(data) // 2], *args, **kwargs)
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(Path, "write_text", half_then_fail)
    with pytest.raises(OSError, match="No space left"):
        write(path, "new content, long enough to be cut in two")
    monkeypatch.undo()
    assert path.read_text() == "old" and sorted(p.name for p in tmp_path.iterdir()) == ["record.json"]
