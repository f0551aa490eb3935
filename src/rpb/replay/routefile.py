"""rpb's route file: the routes an engine (or ``rpb routes``) returned for a data file's rows, with the token ids
they were computed on, in one safetensors file (never pickled).

Shape legend: R = every row's routes back to back, X = the engine's layer axis (every decoder layer, as vLLM and
SGLang size it, or the MoE layers alone), K = top-k, J = the experts stored after the top-k (``top_m`` - K),
T = every row's tokens back to back, N = rows.

Tensors
  routes         int16 [R, X, K]  expert ids, as the engine returned them (dense layers' columns kept as they are)
  token_ids      int64 [T]        the tokens each request was sent (``prompt_token_ids``)
  route_offsets  int64 [N + 1]    row i's routes are ``routes[route_offsets[i]:route_offsets[i + 1]]``
  token_offsets  int64 [N + 1]    row i's tokens likewise
  probs          float32 [R, X, K]  optional (``rpb routes --with-probs``): the model's router probabilities at
                                    each stored expert, under the transform ``probs_transform`` names; engines
                                    return ids alone
  extra_ids      int16 [R, X, J]    optional, version 2 (``rpb routes --with-probs --top-m M``): the next M - K
                                    experts by probability after the selected K, so that ``routes`` and
                                    ``extra_ids`` together are the M stored experts, the selected ones first
  extra_probs    float32 [R, X, J]  the router probabilities at ``extra_ids`` (with ``probs``, under its transform)
Metadata (header key ``rpb_routes``): ``schema``, ``schema_version``, ``engine`` (what produced the routes),
``routers_sha256`` (the model's router fingerprint, ``rpb.adapters``; null for an engine's arrays, which carry no
model identity), ``model`` (null where unknown), ``data_sha256`` (of the data file the requests were made from;
null where unknown), and with ``probs`` its ``probs_transform`` (``rpb.prior.ROUTER_TRANSFORMS``); with
``extra_ids``, ``top_m`` (K + J). Version 2 added the extra tensors and ``top_m``; a version-1 file reads as a
version-2 file without them (M = K).

A row sent as a prefill-only request (its tokens, one generated token that is never forwarded) has one route per
token: ``rpb collect --from-routes`` refuses any other count. The file stores what it is given; the checks
against a model and a data file are the reader's (``rpb.collect.from_routes``).
"""

from __future__ import annotations

import json
import math
import mmap
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from rpb.errors import RpbError
from rpb.prior.artifact import atomic_save

ROUTES_SCHEMA = "rpb_routes"
ROUTES_SCHEMA_VERSION = 2
#: the versions this reader takes (version 1: no extra experts)
READABLE_VERSIONS = (1, 2)
ROUTES_KEY = "rpb_routes"
TENSORS = ("routes", "token_ids", "route_offsets", "token_offsets")
#: tensors a route file may hold besides ``TENSORS``
OPTIONAL = ("probs", "extra_ids", "extra_probs")


#: the stored forms docs/collect.md's table compares: how many experts each keeps per token and layer (from the
#: top-k ``k`` and the experts ``E``) and whether it keeps their probabilities
STORED_FORMS = {
    "ids alone": (lambda k, E: k, False),
    "top-k with probabilities": (lambda k, E: k, True),
    "top-2k with probabilities": (lambda k, E: min(2 * k, E), True),
    "whole distribution": (lambda k, E: E, True),
}


def bytes_per_token(num_layers: int, top_k: int, num_experts: int, form: str) -> int:
    """What a route file of ``form`` (``STORED_FORMS``) spends per token: the int64 token id, and on each of the
    ``num_layers`` decoder layers (the engines' layout: a dense layer's columns are kept) an int16 id per stored
    expert and, with probabilities, a float32 each. Row offsets (16 bytes a row) are left out."""
    experts, with_probs = STORED_FORMS[form]
    M = experts(top_k, num_experts)
    return 8 + num_layers * M * (2 + (4 if with_probs else 0))


class RouteFileError(RpbError):
    """A file that is not a readable rpb route file (every problem named)."""


#: safetensors' dtype names, as a route file's header states them
_DTYPES = {"I16": torch.int16, "I64": torch.int64, "F32": torch.float32, "U8": torch.uint8, "U16": torch.uint16}


@dataclass(frozen=True)
class _Stated:
    """A tensor of the file as its header states it: dtype, shape, and where its bytes lie in the file."""

    dtype: torch.dtype | str
    shape: torch.Size
    start: int = 0
    end: int = 0

    def dim(self) -> int:
        return len(self.shape)

    def numel(self) -> int:
        return math.prod(self.shape)


def read_header(path: str | Path) -> tuple[dict, dict[str, _Stated]]:
    """``(metadata, tensors)`` of a safetensors file from its header alone (8 bytes of length, then JSON): the
    format's own layout (https://github.com/huggingface/safetensors), each tensor's bytes checked to lie in the
    file. Read here rather than through ``safe_open``, which maps the whole file privately and writably: a map the
    kernel counts as the process's data (``RLIMIT_DATA``), where a read-only shared map (``RouteFile``) is not."""
    size = Path(path).stat().st_size
    with open(path, "rb") as f:
        n = int.from_bytes(f.read(8), "little")
        if not 0 < n <= size - 8:
            raise ValueError(f"a header of {n} bytes in a file of {size}")
        header = json.loads(f.read(n))
    meta, stated = header.pop("__metadata__", None) or {}, {}
    for name, info in header.items():
        begin, end = (8 + n + int(x) for x in info["data_offsets"])
        dtype = _DTYPES.get(info["dtype"], info["dtype"])
        itemsize = dtype.itemsize if isinstance(dtype, torch.dtype) else 0
        if not (8 + n <= begin <= end <= size) or (itemsize and end - begin != math.prod(info["shape"]) * itemsize):
            raise ValueError(f"tensor {name!r}: bytes {begin}..{end} do not hold {info['shape']} {info['dtype']}")
        stated[name] = _Stated(dtype, torch.Size(info["shape"]), begin, end)
    return meta, stated


class RowReads:
    """What every reader of routes offers, from its ``rows_of(name, row)`` and ``whole(name)``: one row's routes,
    probabilities, extra experts and tokens, and each tensor whole (``routes_RXK`` and the like: small files)."""

    def routes(self, row: int) -> torch.Tensor:
        """``routes_SXK`` of row ``row`` (int16, as stored)."""
        return self.rows_of("routes", row)

    def probs(self, row: int) -> torch.Tensor:
        """``probs_SXK`` of row ``row`` (float32; the file must hold probabilities)."""
        return self.rows_of("probs", row)

    def extra(self, row: int) -> tuple[torch.Tensor, torch.Tensor]:
        """``(extra_ids_SXJ, extra_probs_SXJ)`` of row ``row`` (the file must hold extra experts)."""
        return self.rows_of("extra_ids", row), self.rows_of("extra_probs", row)

    def tokens(self, row: int) -> list[int]:
        return self.rows_of("token_ids", row).tolist()

    routes_RXK = property(lambda self: self.whole("routes"))
    token_ids_T = property(lambda self: self.whole("token_ids"))
    probs_RXK = property(lambda self: self.whole("probs"))
    extra_ids_RXJ = property(lambda self: self.whole("extra_ids"))
    extra_probs_RXJ = property(lambda self: self.whole("extra_probs"))


class RouteFile(RowReads):
    """A route file read lazily: its row offsets whole (two int64 a row), everything else one row's slice at a time
    from a read-only map of the file (``routes(row)``, ``probs(row)``, ``extra(row)``, ``tokens(row)``), so a reader
    holds no more than the rows it asks for, and the map is the page cache's, not the process's own memory.
    ``routes_RXK`` and the like read a tensor whole (small files, tests). A copy sent to another process maps the
    file anew."""

    def __init__(self, path, metadata: dict, route_offsets, token_offsets, stated: dict[str, _Stated]):
        self.path, self.metadata = str(path), metadata
        self.route_offsets, self.token_offsets = route_offsets, token_offsets
        self.stated = stated
        self._map = None

    def __getstate__(self):
        return {**self.__dict__, "_map": None}

    @property
    def num_rows(self) -> int:
        return self.route_offsets.numel() - 1

    @property
    def has_probs(self) -> bool:
        return "probs" in self.stated

    @property
    def has_extra(self) -> bool:
        return "extra_ids" in self.stated

    @property
    def width(self) -> int:
        """X: the layer axis (every decoder layer, or the MoE layers alone)."""
        return int(self.stated["routes"].shape[1])

    @property
    def top_m(self) -> int:
        """The experts stored per token and layer: the top-k, plus the extra ones."""
        extra = int(self.stated["extra_ids"].shape[2]) if self.has_extra else 0
        return int(self.stated["routes"].shape[2]) + extra

    def _read(self, name: str, first: int, last: int) -> torch.Tensor:
        """Rows ``first:last`` of tensor ``name``, copied out of the map."""
        if self._map is None:
            with open(self.path, "rb") as f:
                self._map = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)
        t = self.stated[name]
        row = math.prod(t.shape[1:]) * t.dtype.itemsize
        view = memoryview(self._map)[t.start + first * row : t.start + last * row]
        out = torch.empty((last - first, *t.shape[1:]), dtype=t.dtype)
        out.view(torch.uint8).reshape(-1).numpy()[:] = np.frombuffer(view, dtype=np.uint8)
        return out

    def rows_of(self, name: str, row: int) -> torch.Tensor:
        """Row ``row``'s part of tensor ``name`` (its routes, or ``token_ids``' tokens)."""
        offsets = self.token_offsets if name == "token_ids" else self.route_offsets
        return self._read(name, int(offsets[row]), int(offsets[row + 1]))

    def whole(self, name: str) -> torch.Tensor | None:
        """Tensor ``name`` read whole into memory (None: the file has none)."""
        return self._read(name, 0, self.stated[name].shape[0]) if name in self.stated else None


def save_routes(
    path: str | Path,
    token_ids: Sequence[Sequence[int]],
    routes: Sequence,
    *,
    engine: str,
    routers_sha256: str | None = None,
    model: str | None = None,
    data_sha256: str | None = None,
    probs: Sequence | None = None,
    probs_transform: str | None = None,
    extra: tuple[Sequence, Sequence] | None = None,
) -> None:
    """Write a route file (atomically): row i sent ``token_ids[i]`` and came back with ``routes[i]``, an integer
    array ``[routes, layers, top_k]`` as the engine returns it (vLLM's ``routed_experts``; SGLang's decoded and
    reshaped, ``rpb.replay.engines.routes_from_sglang``). Every row's layer axis and top-k must agree. ``probs``:
    each row's router probabilities at those experts (same shapes), under ``probs_transform``. ``extra``: with
    ``probs``, each row's next experts by probability and their probabilities (``[routes, layers, J]`` each)."""
    arrays = [np.asarray(r) for r in routes]
    problems = []
    if probs is not None:
        if probs_transform is None:
            problems.append("probabilities without the transform they were read under (probs_transform)")
        shapes_differ = len(probs) != len(arrays) or any(
            np.shape(p) != a.shape for p, a in zip(probs, arrays, strict=False)
        )
        if shapes_differ:
            problems.append("the probabilities' rows do not have the routes' shapes")
    if extra is not None:
        extra_ids, extra_probs = ([np.asarray(a) for a in part] for part in extra)
        if probs is None:
            problems.append("extra experts without the probabilities of the top-k (probs)")
        lead = [a.shape[:2] for a in arrays]
        if [a.shape[:2] for a in extra_ids] != lead or [p.shape for p in extra_probs] != [a.shape for a in extra_ids]:
            problems.append("the extra experts' rows do not have the routes' [routes, layers] and each other's shape")
        elif len({a.shape[2] for a in extra_ids}) > 1:
            problems.append("rows disagree on the number of extra experts")
    if len(arrays) != len(token_ids):
        problems.append(f"{len(arrays)} rows of routes for {len(token_ids)} rows of token ids")
    shapes = {a.shape[1:] for a in arrays if a.ndim == 3}
    bad = [i for i, a in enumerate(arrays) if a.ndim != 3 or a.dtype.kind not in "iu"]
    if bad:
        problems.append(f"rows {bad[:5]}: routes that are not integer [routes, layers, top_k] arrays")
    elif len(shapes) > 1:
        problems.append(f"rows disagree on [layers, top_k]: {sorted(shapes)}")
    top = max((int(a.max()) for a in arrays if a.size and not bad), default=0)
    if top > torch.iinfo(torch.int16).max:
        problems.append(f"expert id {top} does not fit the file's int16 ids")
    if problems:
        raise RouteFileError(f"{path}: cannot write the routes: " + "; ".join(problems))
    width = next(iter(shapes)) if shapes else (0, 0)
    routes_RXK = torch.from_numpy(
        np.concatenate([a.astype(np.int16) for a in arrays]) if arrays else np.zeros((0, *width), np.int16)
    )
    tensors = {
        "routes": routes_RXK,
        "token_ids": torch.tensor([t for row in token_ids for t in row], dtype=torch.int64),
        "route_offsets": torch.tensor(np.cumsum([0, *(len(a) for a in arrays)]), dtype=torch.int64),
        "token_offsets": torch.tensor(np.cumsum([0, *(len(t) for t in token_ids)]), dtype=torch.int64),
    }
    meta = {
        "schema": ROUTES_SCHEMA,
        "schema_version": ROUTES_SCHEMA_VERSION,
        "engine": engine,
        "routers_sha256": routers_sha256,
        "model": model,
        "data_sha256": data_sha256,
    }
    if probs is not None:
        tensors["probs"] = torch.from_numpy(
            np.concatenate([np.asarray(p, np.float32) for p in probs]) if probs else np.zeros((0, *width), np.float32)
        )
        meta["probs_transform"] = probs_transform
    if extra is not None:
        J = extra_ids[0].shape[2] if extra_ids else 0
        tensors["extra_ids"] = torch.from_numpy(_stack(extra_ids, np.int16, (*width[:1], J)))
        tensors["extra_probs"] = torch.from_numpy(_stack(extra_probs, np.float32, (*width[:1], J)))
        meta["top_m"] = int(width[1] + J)
    atomic_save(tensors, {ROUTES_KEY: json.dumps(meta, sort_keys=True)}, path)


def _stack(rows: list[np.ndarray], dtype, width: tuple) -> np.ndarray:
    return np.concatenate([a.astype(dtype) for a in rows]) if rows else np.zeros((0, *width), dtype)


def load_routes(path: str | Path) -> RouteFile:
    """A route file, its layout checked from its header and row offsets (every problem named at once), nothing else
    read; no check against a model or data here."""
    try:
        header, stated = read_header(path)
    except (OSError, ValueError, KeyError, TypeError) as e:  # the header's own faults, whatever their kind
        raise RouteFileError(f"{path}: not a readable safetensors file ({e})") from None
    if ROUTES_KEY not in header:
        raise RouteFileError(f"{path}: no {ROUTES_KEY!r} metadata; not an rpb route file")
    try:
        meta = json.loads(header[ROUTES_KEY])
    except json.JSONDecodeError as e:
        raise RouteFileError(f"{path}: metadata is not valid JSON ({e})") from None
    known = {name: t for name, t in stated.items() if name in (*TENSORS, *OPTIONAL)}
    reader = RouteFile(path, meta, None, None, known)
    offsets = {}
    for name in ("route_offsets", "token_offsets"):
        if name in known and known[name].dtype == torch.int64 and known[name].dim() == 1:
            offsets[name] = reader.whole(name)
    problems = _layout_problems(meta, known | offsets)
    if problems:
        raise RouteFileError(f"{path}: {len(problems)} problem(s):\n" + "\n".join(f"  - {p}" for p in problems))
    reader.route_offsets, reader.token_offsets = offsets["route_offsets"], offsets["token_offsets"]
    return reader


def _layout_problems(meta, tensors: dict[str, torch.Tensor]) -> list[str]:
    problems = []
    if not isinstance(meta, dict) or meta.get("schema") != ROUTES_SCHEMA:
        return [f"metadata: schema is not {ROUTES_SCHEMA!r}"]
    if meta.get("schema_version") not in READABLE_VERSIONS:
        problems.append(f"metadata: schema_version {meta.get('schema_version')!r}, expected one of {READABLE_VERSIONS}")
    missing = [name for name in TENSORS if name not in tensors]
    if missing:
        return [*problems, f"missing tensor(s) {missing}"]
    routes, ids = tensors["routes"], tensors["token_ids"]
    if routes.dim() != 3 or routes.dtype != torch.int16:
        problems.append(f"routes: {routes.dtype} {tuple(routes.shape)}, expected int16 [routes, layers, top_k]")
    if ids.dim() != 1 or ids.dtype != torch.int64:
        problems.append(f"token_ids: {ids.dtype} {tuple(ids.shape)}, expected int64 [tokens]")
    for name, total in (("route_offsets", routes.shape[0]), ("token_offsets", ids.numel())):
        off = tensors[name]
        if off.dim() != 1 or off.dtype != torch.int64 or off.numel() < 1:
            problems.append(f"{name}: {off.dtype} {tuple(off.shape)}, expected int64 [rows + 1]")
        elif int(off[0]) != 0 or int(off[-1]) != total or bool((off[1:] < off[:-1]).any()):
            problems.append(f"{name}: not a non-decreasing run from 0 to {total}")
    probs = tensors.get("probs")
    if probs is not None:
        if probs.dtype != torch.float32 or probs.shape != routes.shape:
            problems.append(f"probs: {probs.dtype} {tuple(probs.shape)}, expected float32 {tuple(routes.shape)}")
        if meta.get("probs_transform") is None:
            problems.append("metadata: probs without probs_transform")
    problems += _extra_problems(meta, tensors)
    if tensors["route_offsets"].numel() != tensors["token_offsets"].numel():
        problems.append("route_offsets and token_offsets count different rows")
    return problems


def _extra_problems(meta: dict, tensors: dict[str, torch.Tensor]) -> list[str]:
    """Version 2's extra experts: both tensors or neither, beside the probabilities, ``[R, X, J]``, ``top_m``."""
    ids, probs, routes = tensors.get("extra_ids"), tensors.get("extra_probs"), tensors["routes"]
    if ids is None and probs is None:
        return ["metadata: top_m without extra_ids"] if "top_m" in meta else []
    if meta.get("schema_version") == 1:
        return ["extra_ids / extra_probs in a version-1 file (they came with schema_version 2)"]
    if ids is None or probs is None or tensors.get("probs") is None:
        return ["extra_ids and extra_probs go together, beside probs"]
    problems = []
    if ids.dim() != 3 or ids.dtype != torch.int16 or ids.shape[:2] != routes.shape[:2]:
        problems.append(
            f"extra_ids: {ids.dtype} {tuple(ids.shape)}, expected int16 [{routes.shape[0]}, {routes.shape[1]}, J]"
        )
    elif probs.dtype != torch.float32 or probs.shape != ids.shape:
        problems.append(f"extra_probs: {probs.dtype} {tuple(probs.shape)}, expected float32 {tuple(ids.shape)}")
    elif meta.get("top_m") != routes.shape[2] + ids.shape[2]:
        problems.append(f"metadata: top_m {meta.get('top_m')!r}, the file stores {routes.shape[2] + ids.shape[2]}")
    return problems
