"""Atomic writes: a file (or directory) appears under its final name only once it is complete.

Everything rpb writes that a later run reads back -- priors, chunk files, manifests, grid
records, rendered data, a cached base model -- is written to a temporary name beside its
destination (same filesystem), flushed to disk, then renamed over it. A run killed at any
moment leaves either the old content or the new, never a file that looks finished and is not;
the temporary is removed on any error (a ``kill -9`` can leave one, named ``.<name>.*.partial``,
which the next run may delete).
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import tempfile
from collections.abc import Iterator
from pathlib import Path

# what a plain open() or mkdir() would give: mkstemp / mkdtemp make private (0600 / 0700) files,
# which other users (or another node's processes, under another uid) could not read
_UMASK = os.umask(0)
os.umask(_UMASK)


@contextlib.contextmanager
def atomic_path(path: str | Path, *, tmp_dir: str | Path | None = None, directory: bool = False) -> Iterator[Path]:
    """Yield a temporary path to write; on success it is synced and renamed to ``path``.

    ``tmp_dir``: where the temporary lives (default: beside ``path``; it must be on the same
    filesystem). ``directory``: the temporary is a fresh directory, which replaces ``path``
    (any directory there is removed first).
    """
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    where = tmp_dir if tmp_dir is not None else path.parent
    if directory:
        tmp = Path(tempfile.mkdtemp(prefix=f".{path.name}.", suffix=".partial", dir=where))
        tmp.chmod(0o777 & ~_UMASK)
    else:
        fd, name = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".partial", dir=where)
        os.close(fd)
        tmp = Path(name)
    try:
        yield tmp
        if not directory:  # after the writer: one that makes the file anew (safetensors' save_file) made it 0600
            tmp.chmod(0o666 & ~_UMASK)
        old = None
        if directory and path.exists():
            # renamed away whole (one step), never deleted in place: a kill leaves the old folder or none
            old = path.with_name(f".{path.name}.{os.getpid()}.{tmp.name[-14:-8]}.old")
            os.replace(path, old)
        elif not directory:
            with open(tmp, "rb") as f:
                os.fsync(f.fileno())
        os.replace(tmp, path)
        if old is not None:
            shutil.rmtree(old, ignore_errors=True)
    except BaseException:
        if directory:
            shutil.rmtree(tmp, ignore_errors=True)
        else:
            tmp.unlink(missing_ok=True)
        raise


@contextlib.contextmanager
def output_folder(path: str | Path, owned) -> Iterator[Path]:
    """A results folder written whole (``rpb calibrate --out``, ``rpb retention --out``): yields a fresh
    folder beside ``path`` to write into, which then replaces ``path``; killed at any point, ``path``
    holds the previous complete result or nothing, never a mix. A ``path`` holding files that
    ``owned(name)`` does not claim is refused, so a folder of the user's is never replaced; what an
    earlier killed run left beside it is removed first."""
    from rpb.errors import ArgumentError

    path = Path(path)
    if path.exists():
        if not path.is_dir():
            raise ArgumentError(f"{path}: exists and is not a folder")
        foreign = sorted(p.name for p in path.iterdir() if not owned(p.name))
        if foreign:
            raise ArgumentError(
                f"{path}: holds files rpb does not write there ({', '.join(foreign[:5])}); "
                "rpb replaces its output folder whole, so choose a new or empty one"
            )
    if path.parent.is_dir():
        for stale in path.parent.glob(f".{path.name}.*"):
            if stale.is_dir() and stale.name.endswith((".partial", ".old")):
                shutil.rmtree(stale, ignore_errors=True)
    with atomic_path(path, directory=True) as tmp:
        yield tmp


def write_text_atomic(path: str | Path, text: str) -> Path:
    with atomic_path(path) as tmp:
        tmp.write_text(text, encoding="utf-8")
    return Path(path)


def write_json_atomic(path: str | Path, obj, indent: int | None = 1) -> Path:
    return write_text_atomic(path, json.dumps(obj, indent=indent))
