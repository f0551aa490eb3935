"""The prior artifact: one safetensors file, self-describing, never pickled.

Tensors
  prior_qa      float32 [N, 2, L, E]  pi[x, s, l, e] (eq. 2); span 0 = Q, 1 = A
  span_tokens   int64   [N, 2]        tokens behind each span mean
  row_sha256    uint8   [N, 32]       sha256 of each data row's bytes, so a validator can
                                      tell an edited row from reordered rows (no text is stored)
Metadata (safetensors header, key ``rpb``): a JSON object, see ``REQUIRED_METADATA``.

Writes are atomic: the file appears under its final name only once complete.
"""

from __future__ import annotations

import json
import os
import tempfile
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors import safe_open
from safetensors.torch import save_file

SCHEMA = "rpb_prior"
SCHEMA_VERSION = 1
METADATA_KEY = "rpb"

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


@dataclass
class PriorArtifact:
    prior_qa: torch.Tensor  # [N, 2, L, E] float32
    span_tokens: torch.Tensor  # [N, 2] int64
    row_sha256: torch.Tensor  # [N, 32] uint8
    metadata: dict

    @property
    def num_rows(self) -> int:
        return self.prior_qa.shape[0]

    def tensors(self) -> dict[str, torch.Tensor]:
        return {"prior_qa": self.prior_qa, "span_tokens": self.span_tokens, "row_sha256": self.row_sha256}


def atomic_save(tensors: dict[str, torch.Tensor], metadata: dict[str, str], path: str | Path) -> None:
    """save_file to a temporary name beside ``path``, fsync, then rename over it."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".partial", dir=path.parent)
    os.close(fd)
    try:
        save_file({k: v.contiguous() for k, v in tensors.items()}, tmp, metadata=metadata)
        with open(tmp, "rb") as f:
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def save_artifact(artifact: PriorArtifact, path: str | Path) -> None:
    meta = {METADATA_KEY: json.dumps(artifact.metadata, sort_keys=True), "format": "pt"}
    atomic_save(artifact.tensors(), meta, path)


class ArtifactError(ValueError):
    pass


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


def load_artifact(path: str | Path) -> PriorArtifact:
    """Load tensors and metadata through safetensors (no pickle on this path)."""
    meta = read_metadata(path)
    tensors = {}
    with safe_open(str(path), framework="pt") as f:
        missing = {"prior_qa", "span_tokens", "row_sha256"} - set(f.keys())
        if missing:
            raise ArtifactError(f"{path}: missing tensor(s) {sorted(missing)}")
        for name in ("prior_qa", "span_tokens", "row_sha256"):
            tensors[name] = f.get_tensor(name)
    return PriorArtifact(metadata=meta, **tensors)
