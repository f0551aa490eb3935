"""The prior artifact: one safetensors file, self-describing, never pickled.

Tensors
  prior_qa      float32 [N, 2, L, E]  pi[x, s, l, e] (eq. 2); span 0 = Q, 1 = A
  span_tokens   int64   [N, 2]        tokens behind each span mean
  row_sha256    uint8   [N, 32]       sha256 of each data row's bytes, so a validator can
                                      tell an edited row from reordered rows (no text is stored)
Metadata (safetensors header, key ``rpb``): a JSON object, see ``REQUIRED_METADATA``; from schema 3 on it
also holds ``tensors_sha256``, the sha256 of the file's data section (every tensor byte after the header,
in file order), so that a changed bit that leaves every value plausible is still caught.

Writes are atomic: the file appears under its final name only once complete. A prior too
large for memory is written tensor by tensor (``write_streamed``: the safetensors layout is an
8-byte little-endian header length, a JSON header, then the raw little-endian tensor bytes), and
read memory-mapped (``load_artifact``): the tensors are views of the page cache, so every
process on a node that loads the same prior shares one copy. ``load_artifact`` reads; what a
command loads is checked first (``rpb.prior.checks.load_prior``).
"""

from __future__ import annotations

import hashlib
import json
import math
import os
import struct
import sys
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors import safe_open
from safetensors.torch import save_file

from rpb.errors import RpbError
from rpb.fileio import atomic_path

SCHEMA = "rpb_prior"
#: 2: the chat template's keyword arguments and pinned date, and the reasoning count, are recorded;
#: 3: ``tensors_sha256``; 4: ``prior_kind`` (probability, or an engine's selection frequency)
SCHEMA_VERSION = 4
#: what a reader accepts: a schema-2 prior has no hash of its tensors (read with a note); before 4, every prior
#: is a probability prior
READABLE_SCHEMA_VERSIONS = (2, 3, 4)
#: the schema that added ``prior_kind``
PRIOR_KIND_SCHEMA = 4
METADATA_KEY = "rpb"
#: metadata field: sha256 (hex) of the data section
TENSORS_SHA256 = "tensors_sha256"
#: what a streamed write puts in the header before the hash is known, patched in place (same width)
HASH_PLACEHOLDER = "0" * 64

#: routed-position rule recorded in the metadata: every position of the right-truncated sequence
ROUTED_ALL_POSITIONS = "all-positions-of-truncated-sequence"

REQUIRED_METADATA: dict[str, type | tuple[type, ...]] = {
    "schema": str,
    "schema_version": int,
    "rpb_version": str,
    "model": str,
    "model_type": str,
    "model_config_sha256": str,
    "routers_sha256": str,
    "tokenizer": str,
    "chat_template_sha256": str,
    "chat_template_kwargs": dict,
    "chat_template_date": (str, type(None)),
    "reasoning": dict,
    "router_transform": str,
    "top_k": int,
    "max_seq_len": int,
    "routed_positions": str,
    "moe_layers": list,
    "num_experts": int,
    "num_rows": int,
    "data_sha256": str,
    "spans": list,
}


def prior_kind_of(meta: dict) -> str:
    """A prior's kind (``rpb.prior.PRIOR_KINDS``): its ``prior_kind``, or ``probability`` before schema 4."""
    return meta.get("prior_kind", "probability")


@dataclass
class PriorArtifact:
    prior_qa: torch.Tensor  # [N, 2, L, E] float32
    span_tokens: torch.Tensor  # [N, 2] int64
    row_sha256: torch.Tensor  # [N, 32] uint8
    metadata: dict

    @property
    def num_rows(self) -> int:
        return self.prior_qa.shape[0]

    @property
    def kind(self) -> str:
        return prior_kind_of(self.metadata)

    def tensors(self) -> dict[str, torch.Tensor]:
        return {"prior_qa": self.prior_qa, "span_tokens": self.span_tokens, "row_sha256": self.row_sha256}


def atomic_save(tensors: dict[str, torch.Tensor], metadata: dict[str, str], path: str | Path) -> None:
    """safetensors' ``save_file``, atomically (``rpb.fileio.atomic_path``)."""
    with atomic_path(path) as tmp:
        save_file({k: v.contiguous() for k, v in tensors.items()}, str(tmp), metadata=metadata)


def header_metadata(metadata: dict) -> dict[str, str]:
    """The safetensors ``__metadata__`` of an artifact with ``metadata``."""
    return {METADATA_KEY: json.dumps(metadata, sort_keys=True), "format": "pt"}


def save_artifact(artifact: PriorArtifact, path: str | Path) -> None:
    """Write ``artifact`` (atomically), its ``tensors_sha256`` computed before the header is written."""
    tensors = {name: t.detach().cpu().contiguous() for name, t in artifact.tensors().items()}
    digest = hashlib.sha256()
    for t in tensors.values():  # the order write_streamed lays them out in
        digest.update(_raw_bytes(t))
    meta = {**artifact.metadata, TENSORS_SHA256: digest.hexdigest()}
    specs = [TensorSpec(name, t.dtype, tuple(t.shape)) for name, t in tensors.items()]
    write_streamed(path, specs, header_metadata(meta), lambda spec: [tensors[spec.name]])


# ---- streamed writing ------------------------------------------------------------------------

#: safetensors dtype names that can be viewed in place (others are read as copies)
# fmt: skip below: a table of data, kept aligned row by row (the formatter would put one item per line)
_MAPPABLE = {
    "F64": torch.float64, "F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16,
    "I64": torch.int64, "I32": torch.int32, "I16": torch.int16, "I8": torch.int8, "U8": torch.uint8,
    "BOOL": torch.bool,
}  # fmt: skip
#: safetensors dtype names of what ``write_streamed`` writes
ST_DTYPES = {dtype: name for name, dtype in _MAPPABLE.items()}
#: the data section starts on this boundary, so that every tensor can be viewed in place
HEADER_ALIGN = 8


@dataclass(frozen=True)
class TensorSpec:
    name: str
    dtype: torch.dtype
    shape: tuple[int, ...]

    @property
    def nbytes(self) -> int:
        return math.prod(self.shape) * self.dtype.itemsize


def safetensors_header(specs: list[TensorSpec], metadata: dict[str, str]) -> bytes:
    """Length prefix and JSON header of a file holding ``specs`` back to back, in that order."""
    header: dict = {"__metadata__": metadata}
    offset = 0
    for s in specs:
        entry = {"dtype": ST_DTYPES[s.dtype], "shape": list(s.shape), "data_offsets": [offset, offset + s.nbytes]}
        header[s.name] = entry
        offset += s.nbytes
    raw = json.dumps(header, separators=(",", ":")).encode()
    raw += b" " * (-(8 + len(raw)) % HEADER_ALIGN)  # spaces are valid JSON padding, as safetensors pads
    return struct.pack("<Q", len(raw)) + raw


def _raw_bytes(t: torch.Tensor) -> memoryview:
    """A contiguous CPU tensor's bytes as they lie (little-endian machines only, see ``write_streamed``)."""
    return memoryview(t.reshape(-1).view(torch.uint8).numpy())


def write_streamed(
    path: str | Path,
    specs: list[TensorSpec],
    metadata: dict[str, str],
    pieces: Callable[[TensorSpec], Iterable[torch.Tensor]],
    tmp_dir: str | Path | None = None,
    hash_slot: bytes | None = None,
) -> str:
    """Write a safetensors file without holding its tensors: ``pieces(spec)`` yields each tensor's
    consecutive slices along its first axis. Atomic like ``atomic_save``; the temporary file lives
    in ``tmp_dir`` (same filesystem as ``path``; default: beside it). Returns the sha256 (hex) of the
    data section. ``hash_slot``: bytes that occur once in the header and end in ``HASH_PLACEHOLDER``,
    overwritten in place with that hash before the file gets its name."""
    if sys.byteorder != "little":  # safetensors is little-endian and the bytes are written as they lie
        raise RuntimeError("write_streamed needs a little-endian machine")
    header = safetensors_header(specs, metadata)
    if hash_slot is not None:
        if not hash_slot.endswith(HASH_PLACEHOLDER.encode()) or header.count(hash_slot) != 1:
            raise ValueError(f"the header holds {header.count(hash_slot)} hash placeholder(s), not one")
        slot_at = header.index(hash_slot) + len(hash_slot) - len(HASH_PLACEHOLDER)
    digest = hashlib.sha256()
    with atomic_path(path, tmp_dir=tmp_dir) as tmp, open(tmp, "wb") as f:
        f.write(header)
        for spec in specs:
            written = 0
            for piece in pieces(spec):
                if piece.dtype != spec.dtype or tuple(piece.shape[1:]) != spec.shape[1:]:
                    raise ValueError(
                        f"{spec.name}: a piece of {piece.dtype} {tuple(piece.shape)} does not fit "
                        f"{spec.dtype} {spec.shape}"
                    )
                data = _raw_bytes(piece.detach().cpu().contiguous())
                f.write(data)
                digest.update(data)
                written += data.nbytes
            if written != spec.nbytes:
                raise ValueError(f"{spec.name}: {written} bytes written, the header says {spec.nbytes}")
        if hash_slot is not None:
            f.seek(slot_at)
            f.write(digest.hexdigest().encode())
    return digest.hexdigest()


def stream_artifact(
    path: str | Path,
    specs: list[TensorSpec],
    metadata: dict,
    pieces: Callable[[TensorSpec], Iterable[torch.Tensor]],
    tmp_dir: str | Path | None = None,
) -> str:
    """``write_streamed`` for an artifact with ``metadata``: the header goes first, so its
    ``tensors_sha256`` is a placeholder until every tensor byte is written and hashed."""
    field = json.dumps({TENSORS_SHA256: HASH_PLACEHOLDER})[1:-1]  # "tensors_sha256": "00...0"
    # as it lies in the header (JSON inside a JSON string, header_metadata's encoding), up to the placeholder's end
    slot = json.dumps(field[:-1])[1:-1].encode()
    meta = header_metadata({**metadata, TENSORS_SHA256: HASH_PLACEHOLDER})
    return write_streamed(path, specs, meta, pieces, tmp_dir, hash_slot=slot)


def tensors_sha256(path: str | Path) -> str:
    """sha256 (hex) of a safetensors file's data section: every byte after its header."""
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        (header_len,) = struct.unpack("<Q", f.read(8))
        f.seek(8 + header_len)
        while block := f.read(1 << 24):
            digest.update(block)
    return digest.hexdigest()


class ArtifactError(RpbError):
    """A file that is not a readable rpb prior artifact."""


def read_metadata(path: str | Path) -> dict:
    """The artifact's JSON metadata, read from the header alone (no tensor is loaded)."""
    try:
        with safe_open(str(path), framework="pt") as f:
            header = f.metadata() or {}
    except Exception as e:  # safetensors raises its own error types for bad headers
        raise ArtifactError(f"{path}: not a readable safetensors file ({e})") from None
    if METADATA_KEY not in header:
        raise ArtifactError(f"{path}: no {METADATA_KEY!r} metadata; not an rpb prior artifact")
    try:
        meta = json.loads(header[METADATA_KEY])
    except json.JSONDecodeError as e:
        raise ArtifactError(f"{path}: metadata is not valid JSON ({e})") from None
    if not isinstance(meta, dict):
        raise ArtifactError(f"{path}: metadata must be a JSON object")
    return meta


TENSOR_NAMES = ("prior_qa", "span_tokens", "row_sha256")


def map_tensors(path: str | Path, names: Iterable[str]) -> dict[str, torch.Tensor]:
    """``names`` of a safetensors file as views of one private file mapping.

    The mapping is ``MAP_PRIVATE`` (``shared=False``): pages that are only read stay the page
    cache's, shared by every process mapping the file; a write would copy its page for this
    process alone and never reach the file. Call it on files safetensors has opened already
    (it checks the header's offsets against the file size); tensors of other dtypes, or not
    aligned for their dtype, are read through safetensors as copies.
    """
    path = str(path)
    size = os.path.getsize(path)
    with open(path, "rb") as f:
        (header_len,) = struct.unpack("<Q", f.read(8))
        header = json.loads(f.read(header_len))
    storage = torch.UntypedStorage.from_file(path, shared=False, nbytes=size)
    out = {}
    for name in names:
        info = header[name]
        dtype, shape = _MAPPABLE.get(info["dtype"]), tuple(info["shape"])
        begin, end = (8 + header_len + o for o in info["data_offsets"])
        if dtype is None or begin % dtype.itemsize:
            with safe_open(path, framework="pt") as f:
                out[name] = f.get_tensor(name).clone()
            continue
        if end > size or end - begin != math.prod(shape) * dtype.itemsize:
            raise ArtifactError(f"{path}: tensor {name!r} has offsets that do not fit its shape or the file")
        out[name] = torch.empty(0, dtype=dtype).set_(storage, begin // dtype.itemsize, shape)
    return out


def load_artifact(path: str | Path, mmap: bool = True) -> PriorArtifact:
    """Load tensors and metadata through safetensors (no pickle on this path).

    ``mmap`` (default): the tensors are views of the file (see ``map_tensors``), so a prior far
    larger than memory loads instantly and the ranks of one node share it; False reads copies.
    """
    meta = read_metadata(path)
    with safe_open(str(path), framework="pt") as f:
        missing = set(TENSOR_NAMES) - set(f.keys())
        if missing:
            raise ArtifactError(f"{path}: missing tensor(s) {sorted(missing)}")
        if not mmap:
            return PriorArtifact(metadata=meta, **{name: f.get_tensor(name).clone() for name in TENSOR_NAMES})
    return PriorArtifact(metadata=meta, **map_tensors(path, TENSOR_NAMES))
