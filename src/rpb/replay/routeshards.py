"""A route file in shards: a directory of route files, each a run of rows, and one ``index.json``; what a sharded,
resumable ``rpb routes --chunk-rows N`` writes (``rpb.collect.hf_routes.write_route_shards``), read as one file.

``index.json``: ``schema`` ``rpb_routes_index``, ``schema_version`` 1, ``num_rows``, ``metadata`` (what every shard's
route metadata holds in common: ``engine``, ``routers_sha256``, ``model``, ``data_sha256``, ``probs_transform``,
``top_m``), and ``shards``, each ``{"file": name, "rows": [start, stop]}`` in row order, covering every row once.
Each shard is a route file (``rpb.replay.routefile``) of its rows, numbered from 0.

``open_routes`` is what every reader calls: a single route file (either schema version) or a shard directory, the
same interface (``RouteFile``'s: ``num_rows``, ``metadata``, ``routes(row)`` and the like, ``whole(name)``).
"""

from __future__ import annotations

import bisect
import hashlib
import json
from dataclasses import replace
from pathlib import Path

import torch

from rpb.data.jsonl import file_sha256
from rpb.fileio import write_text_atomic
from rpb.replay.routefile import RouteFile, RouteFileError, RowReads, load_routes

INDEX = "index.json"
INDEX_SCHEMA = "rpb_routes_index"
INDEX_VERSION = 1
#: the route metadata every shard must share with the index
SHARED = ("engine", "routers_sha256", "model", "data_sha256", "probs_transform", "top_m")


def open_routes(path: str | Path) -> RouteFile | RouteShards:
    """The routes at ``path``: a route file, or a directory of shards with its ``index.json``."""
    return load_route_shards(path) if Path(path).is_dir() else load_routes(path)


def routes_sha256(path: str | Path) -> str:
    """What the routes at ``path`` are, as one digest: a route file's sha256, or a shard directory's over its
    index and each shard's sha256 in row order (a run pins it: the routes may move, not change)."""
    path = Path(path)
    if not path.is_dir():
        return file_sha256(path)
    index = (path / INDEX).read_bytes()
    shards = [s["file"] for s in json.loads(index).get("shards", [])]
    return hashlib.sha256(index + "".join(file_sha256(path / f) for f in shards).encode()).hexdigest()


def write_index(folder: str | Path, shards: list[tuple[str, int, int]], metadata: dict) -> None:
    """``index.json`` of the shards ``(file, start, stop)`` in ``folder`` (atomically)."""
    num_rows = shards[-1][2] if shards else 0
    index = {
        "schema": INDEX_SCHEMA,
        "schema_version": INDEX_VERSION,
        "num_rows": num_rows,
        "metadata": {k: metadata.get(k) for k in SHARED},
        "shards": [{"file": f, "rows": [a, b]} for f, a, b in shards],
    }
    write_text_atomic(Path(folder) / INDEX, json.dumps(index, indent=1, sort_keys=True) + "\n")


class RouteShards(RowReads):
    """A shard directory read as one route file: each row's reads go to its shard (mapped on first use)."""

    def __init__(self, path: Path, metadata: dict, parts: list[RouteFile], starts: list[int], num_rows: int):
        self.path, self.metadata, self.parts, self.starts = str(path), metadata, parts, starts
        self._num_rows = num_rows
        first = parts[0].stated
        total = sum(p.stated["routes"].shape[0] for p in parts)
        tokens = sum(p.stated["token_ids"].shape[0] for p in parts)
        self.stated = {
            name: replace(t, shape=torch.Size((tokens if name == "token_ids" else total, *t.shape[1:])))
            for name, t in first.items()
            if name not in ("route_offsets", "token_offsets")
        }

    num_rows = property(lambda self: self._num_rows)
    has_probs = property(lambda self: self.parts[0].has_probs)
    has_extra = property(lambda self: self.parts[0].has_extra)
    width = property(lambda self: self.parts[0].width)
    top_m = property(lambda self: self.parts[0].top_m)

    def _at(self, row: int) -> tuple[RouteFile, int]:
        i = bisect.bisect_right(self.starts, row) - 1
        return self.parts[i], row - self.starts[i]

    def rows_of(self, name: str, row: int) -> torch.Tensor:
        part, local = self._at(row)
        return part.rows_of(name, local)

    def whole(self, name: str) -> torch.Tensor | None:
        """Tensor ``name`` of every shard, in row order, read whole into memory (None: the shards have none)."""
        return torch.cat([p.whole(name) for p in self.parts]) if name in self.stated else None


def _layout(part: RouteFile) -> dict:
    """What every shard must share beside its row count: each tensor's dtype and trailing shape."""
    return {k: (t.dtype, tuple(t.shape[1:])) for k, t in part.stated.items() if not k.endswith("offsets")}


def load_route_shards(folder: str | Path) -> RouteShards:
    """The shard directory ``folder``, its index and every shard's header checked (every problem named at once):
    the shards cover the rows in order, each holds its rows, and all share the index's metadata and layout."""
    folder = Path(folder)
    try:
        index = json.loads((folder / INDEX).read_text())
    except (OSError, json.JSONDecodeError) as e:
        raise RouteFileError(f"{folder}: a directory without a readable {INDEX} ({e}): not a shard directory") from None
    if not isinstance(index, dict) or index.get("schema") != INDEX_SCHEMA or index.get("schema_version") != 1:
        raise RouteFileError(f"{folder / INDEX}: not an rpb route index (schema {INDEX_SCHEMA!r}, version 1)")
    problems, parts, starts, at = [], [], [], 0
    meta = index.get("metadata") or {}
    for shard in index.get("shards") or []:
        a, b = shard["rows"]
        if a != at or b < a:
            problems.append(f"{folder / INDEX}: shard {shard['file']} holds rows {a}..{b}, the next rows are {at}..")
        try:
            part = load_routes(folder / shard["file"])
        except RouteFileError as e:
            problems.append(str(e))
            at = b
            continue
        if part.num_rows != b - a:
            problems.append(f"{folder / shard['file']}: {part.num_rows} rows, the index says {b - a}")
        differ = [k for k in SHARED if part.metadata.get(k) != meta.get(k)]
        if differ:
            problems.append(f"{folder / shard['file']}: its {', '.join(differ)} differ from the index's")
        if parts and _layout(part) != _layout(parts[0]):
            problems.append(f"{folder / shard['file']}: its tensors' layout differs from the first shard's")
        parts.append(part)
        starts.append(a)
        at = b
    if at != index.get("num_rows") or not parts:
        problems.append(f"{folder / INDEX}: the shards cover {at} rows of the index's {index.get('num_rows')}")
    if problems:
        raise RouteFileError(f"{folder}: {len(problems)} problem(s):\n" + "\n".join(f"  - {p}" for p in problems))
    return RouteShards(folder, {**parts[0].metadata, **meta}, parts, starts, at)
