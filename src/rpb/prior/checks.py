"""What a prior file must hold, checked on the file alone: metadata, tensors, values, tensor hash.

``rpb validate`` reports these problems (with its checks against the data and model); every command
that reads a prior loads it through ``load_prior``, which refuses with the same messages before any
model is loaded. The values are checked a block of rows at a time, so a memory-mapped prior far
larger than memory is checked without a copy of it.
"""

from __future__ import annotations

import logging
import math
import re
from pathlib import Path

import torch

from rpb.prior.artifact import (
    PRIOR_KIND_SCHEMA,
    READABLE_SCHEMA_VERSIONS,
    REQUIRED_METADATA,
    SCHEMA,
    TENSORS_SHA256,
    ArtifactError,
    PriorArtifact,
    load_artifact,
    tensors_sha256,
)
from rpb.prior.math import PRIOR_KINDS

logger = logging.getLogger(__name__)

#: each [sample, span, layer] row of prior_qa sums to 1 within this
ROW_SUM_TOLERANCE = 1e-4
#: about this many values of prior_qa are checked at a time
CHECK_BLOCK_VALUES = 1 << 24

_noted: set[str] = set()  # files whose missing hash was noted (once per file and process)


def format_problems(path: str | Path, problems: list[str]) -> str:
    """``rpb validate``'s listing of a file's problems."""
    return "\n".join([f"{path}: {len(problems)} problem(s)", *(f"  - {p}" for p in problems)])


def metadata_problems(meta: dict) -> list[str]:
    problems = []
    for key, kind in REQUIRED_METADATA.items():
        if key not in meta:
            problems.append(f"metadata: missing field {key!r}")
        elif not isinstance(meta[key], kind) or isinstance(meta[key], bool):
            expected = " or ".join(k.__name__ for k in (kind if isinstance(kind, tuple) else (kind,)))
            problems.append(f"metadata: field {key!r} should be {expected}, got {type(meta[key]).__name__}")
    if meta.get("schema") != SCHEMA:
        problems.append(f"metadata: schema is {meta.get('schema')!r}, expected {SCHEMA!r}")
    version = meta.get("schema_version")
    if version not in READABLE_SCHEMA_VERSIONS or isinstance(version, bool):
        problems.append(f"metadata: schema_version {version!r} is not one of {list(READABLE_SCHEMA_VERSIONS)}")
    kind = meta.get("prior_kind")
    if isinstance(version, int) and version >= PRIOR_KIND_SCHEMA and kind not in PRIOR_KINDS:
        problems.append(f"metadata: field 'prior_kind' is {kind!r}, expected one of {list(PRIOR_KINDS)}")
    digest = meta.get(TENSORS_SHA256)
    if digest is None and isinstance(version, int) and version >= 3:
        problems.append(f"metadata: missing field {TENSORS_SHA256!r} (schema {version})")
    elif digest is not None and not (isinstance(digest, str) and re.fullmatch("[0-9a-f]{64}", digest)):
        problems.append(f"metadata: field {TENSORS_SHA256!r} should be 64 hexadecimal digits, got {digest!r}")
    return problems


def value_problems(prior: torch.Tensor) -> list[str]:
    """Non-finite and negative values, and [sample, span, layer] rows that do not sum to 1, of a
    ``[N, S, L, E]`` prior: each counted over the whole tensor, with the first place it occurs."""
    nonfinite = negative = off_rows = 0
    first_nonfinite = first_negative = first_off = None
    step = max(1, CHECK_BLOCK_VALUES // max(1, math.prod(prior.shape[1:])))
    for start in range(0, prior.shape[0], step):
        block = prior[start : start + step]
        finite = torch.isfinite(block)
        if not finite.all():
            nonfinite += int((~finite).sum())
            if first_nonfinite is None:
                first_nonfinite = _at(start, (~finite).nonzero()[0])
        if (block < 0).any():
            negative += int((block < 0).sum())
            if first_negative is None:
                first_negative = _at(start, (block < 0).nonzero()[0])
        sums = block.double().sum(dim=-1)
        off = (sums - 1).abs() > ROW_SUM_TOLERANCE
        if off.any():
            off_rows += int(off.sum())
            if first_off is None:
                where = off.nonzero()[0]
                first_off = (_at(start, where), float(sums[tuple(where.tolist())]))
    problems = []
    if nonfinite:
        problems.append(
            f"prior_qa: {nonfinite} non-finite value(s), first at [sample, span, layer, expert]={first_nonfinite}"
        )
    if negative:
        problems.append(f"prior_qa: {negative} negative value(s), first at {first_negative}")
    if off_rows:
        problems.append(
            f"prior_qa: {off_rows} [sample, span, layer] row(s) do not sum to 1 (tolerance "
            f"{ROW_SUM_TOLERANCE}); first at {first_off[0]}, sum {first_off[1]:.6f}"
        )
    return problems


def _at(start: int, index: torch.Tensor) -> list[int]:
    """A block's index as an index into the whole tensor."""
    return [start + int(index[0]), *index[1:].tolist()]


def tensor_problems(art: PriorArtifact) -> list[str]:
    """The tensors' dtypes and shapes against the metadata, and prior_qa's values."""
    problems = []
    prior, meta = art.prior_qa, art.metadata
    n, layers, experts = meta.get("num_rows"), meta.get("moe_layers"), meta.get("num_experts")
    expected = (n, 2, len(layers) if isinstance(layers, list) else None, experts)
    if prior.dtype != torch.float32:
        problems.append(f"prior_qa: dtype {prior.dtype}, expected float32")
    if tuple(prior.shape) != expected:
        problems.append(
            f"prior_qa: shape {tuple(prior.shape)}, metadata says [rows, 2, MoE layers, experts] = {expected}"
        )
    if prior.dim() != 4:
        return problems
    problems += value_problems(prior)
    if tuple(art.span_tokens.shape) != (prior.shape[0], 2):
        problems.append(f"span_tokens: shape {tuple(art.span_tokens.shape)}, expected ({prior.shape[0]}, 2)")
    elif (art.span_tokens < 1).any():
        bad = (art.span_tokens < 1).nonzero()[0].tolist()
        problems.append(f"span_tokens: a span without tokens at [sample, span]={bad}")
    if tuple(art.row_sha256.shape) != (prior.shape[0], 32):
        problems.append(f"row_sha256: shape {tuple(art.row_sha256.shape)}, expected ({prior.shape[0]}, 32)")
    return problems


def hash_problems(path: str | Path, meta: dict) -> list[str]:
    """The data section's sha256 against the recorded ``tensors_sha256`` (none recorded: nothing to check)."""
    recorded = meta.get(TENSORS_SHA256)
    if not isinstance(recorded, str):
        return []
    found = tensors_sha256(path)
    if found == recorded:
        return []
    return [
        f"{TENSORS_SHA256}: the tensor bytes hash to {found[:16]}..., the metadata records {recorded[:16]}...: "
        "the file changed after it was written; collect it again"
    ]


def file_problems(path: str | Path, art: PriorArtifact) -> list[str]:
    """Every problem of the file alone (``rpb validate`` without data or model)."""
    return metadata_problems(art.metadata) + tensor_problems(art) + hash_problems(path, art.metadata)


def note_unhashed(path: str | Path, meta: dict) -> None:
    """Say once per file that a schema-2 prior carries no hash of its tensors."""
    key = str(Path(path).resolve())
    if TENSORS_SHA256 in meta or key in _noted:
        return
    _noted.add(key)
    logger.warning(
        "rpb: %s: schema %s prior without %s: its values are checked, its tensor bytes cannot be "
        "(collect it again to add the hash)",
        path,
        meta.get("schema_version"),
        TENSORS_SHA256,
    )


def load_prior(path: str | Path, mmap: bool = True) -> PriorArtifact:
    """The prior at ``path`` (``load_artifact``), checked as ``rpb validate`` checks the file: raises
    ``ArtifactError`` listing every problem, before any model is loaded."""
    art = load_artifact(path, mmap)
    problems = file_problems(path, art)
    if problems:
        raise ArtifactError(format_problems(path, problems))
    note_unhashed(path, art.metadata)
    return art
