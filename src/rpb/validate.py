"""Checks that a prior artifact is well-formed and belongs to the data and model at hand.

Every problem is collected (none stops the others from being checked); the caller
prints them all and exits non-zero when there is any. The model is judged as ``rpb train``
judges it (``rpb.anchors.verify.model_mismatches``): by its routers' fingerprint, top-k,
MoE layers and experts, read from the checkpoint's safetensors shards without loading it.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from pathlib import Path

import torch

from rpb.adapters import checkpoint_routers_sha256
from rpb.adapters.aliases import register_model_aliases
from rpb.anchors.verify import model_mismatches
from rpb.artifact import REQUIRED_METADATA, SCHEMA, SCHEMA_VERSION, ArtifactError, load_artifact
from rpb.data.jsonl import file_sha256, row_digests
from rpb.errors import RpbError
from rpb.retention.metrics import entropy_bits

ROW_SUM_TOLERANCE = 1e-4


@dataclass
class ValidationReport:
    path: str
    problems: list[str] = field(default_factory=list)
    summary: dict = field(default_factory=dict)

    @property
    def ok(self) -> bool:
        return not self.problems

    def format(self) -> str:
        if not self.ok:
            head = f"{self.path}: {len(self.problems)} problem(s)"
            return "\n".join([head, *(f"  - {p}" for p in self.problems)])
        s = self.summary
        lines = [
            f"{self.path}: OK",
            f"  samples {s['samples']}, MoE layers {s['layers']} (model layers {s['moe_layers']}), "
            f"experts {s['experts']}, transform {s['router_transform']}, top-k {s['top_k']}",
            f"  per-layer utilization entropy (bits; max log2 E = {math.log2(s['experts']):.3f}), Q / A:",
        ]
        for layer, hq, ha in zip(s["moe_layers"], s["entropy_q_bits"], s["entropy_a_bits"], strict=True):
            lines.append(f"    layer {layer:3d}: {hq:.3f} / {ha:.3f}")
        return "\n".join(lines)


def utilization_entropy_bits(prior_NSLE: torch.Tensor) -> torch.Tensor:
    """Entropy (bits) of the mean prior over samples, per span and layer: ``[S, L]``."""
    return entropy_bits(prior_NSLE.double().mean(dim=0))


def _check_metadata(meta: dict, problems: list[str]) -> None:
    for key, kind in REQUIRED_METADATA.items():
        if key not in meta:
            problems.append(f"metadata: missing field {key!r}")
        elif not isinstance(meta[key], kind) or isinstance(meta[key], bool):
            expected = " or ".join(k.__name__ for k in (kind if isinstance(kind, tuple) else (kind,)))
            problems.append(f"metadata: field {key!r} should be {expected}, got {type(meta[key]).__name__}")
    if meta.get("schema") != SCHEMA:
        problems.append(f"metadata: schema is {meta.get('schema')!r}, expected {SCHEMA!r}")
    if meta.get("schema_version") != SCHEMA_VERSION:
        problems.append(f"metadata: schema_version {meta.get('schema_version')!r} is not {SCHEMA_VERSION}")


def _check_tensors(art, meta: dict, problems: list[str]) -> None:
    prior = art.prior_qa
    n, layers, experts = meta.get("num_rows"), meta.get("moe_layers"), meta.get("num_experts")
    expected = (n, 2, len(layers) if isinstance(layers, list) else None, experts)
    if prior.dtype != torch.float32:
        problems.append(f"prior_qa: dtype {prior.dtype}, expected float32")
    if tuple(prior.shape) != expected:
        problems.append(
            f"prior_qa: shape {tuple(prior.shape)}, metadata says [rows, 2, MoE layers, experts] = {expected}"
        )
    if prior.dim() != 4:
        return
    finite = torch.isfinite(prior)
    if not finite.all():
        bad = (~finite).nonzero()[0].tolist()
        problems.append(
            f"prior_qa: {int((~finite).sum())} non-finite value(s), first at [sample, span, layer, expert]={bad}"
        )
    if (prior < 0).any():
        bad = (prior < 0).nonzero()[0].tolist()
        problems.append(f"prior_qa: {int((prior < 0).sum())} negative value(s), first at {bad}")
    sums = prior.double().sum(dim=-1)
    off = (sums - 1).abs() > ROW_SUM_TOLERANCE
    if off.any():
        first = off.nonzero()[0].tolist()
        problems.append(
            f"prior_qa: {int(off.sum())} [sample, span, layer] row(s) do not sum to 1 (tolerance "
            f"{ROW_SUM_TOLERANCE}); first at {first}, sum {float(sums[tuple(first)]):.6f}"
        )
    if tuple(art.span_tokens.shape) != (prior.shape[0], 2):
        problems.append(f"span_tokens: shape {tuple(art.span_tokens.shape)}, expected ({prior.shape[0]}, 2)")
    elif (art.span_tokens < 1).any():
        bad = (art.span_tokens < 1).nonzero()[0].tolist()
        problems.append(f"span_tokens: a span without tokens at [sample, span]={bad}")
    if tuple(art.row_sha256.shape) != (prior.shape[0], 32):
        problems.append(f"row_sha256: shape {tuple(art.row_sha256.shape)}, expected ({prior.shape[0]}, 32)")


def _check_data(art, meta: dict, data_jsonl: Path, problems: list[str]) -> None:
    if not data_jsonl.is_file():
        problems.append(f"data: {data_jsonl} does not exist")
        return
    sha = file_sha256(data_jsonl)
    if sha != meta.get("data_sha256"):
        problems.append(
            f"data: {data_jsonl} has sha256 {sha[:16]}..., the prior was collected on "
            f"{str(meta.get('data_sha256'))[:16]}... (file {meta.get('data_file')!r})"
        )
    digests = row_digests(data_jsonl)
    if len(digests) != meta.get("num_rows"):
        problems.append(f"data: {data_jsonl} has {len(digests)} rows, the prior has {meta.get('num_rows')}")
    if sha == meta.get("data_sha256") or tuple(art.row_sha256.shape[1:]) != (32,):
        return
    recorded = [bytes(r) for r in art.row_sha256.tolist()]
    recorded_line = {d: i + 1 for i, d in reversed(list(enumerate(recorded)))}
    moved, edited = [], []
    for i, d in enumerate(digests):
        if i < len(recorded) and recorded[i] == d:
            continue
        if d in recorded_line:
            moved.append(f"line {i + 1} was line {recorded_line[d]}")
        else:
            edited.append(i + 1)
    if moved:
        problems.append(f"data: {len(moved)} row(s) reordered or shifted ({', '.join(moved[:5])})")
    if edited:
        problems.append(f"data: {len(edited)} row(s) not in the collected data (edited?), at line(s) {edited[:10]}")
    gone = len(set(recorded) - set(digests))
    if gone:
        problems.append(f"data: {gone} collected row(s) are no longer in the file")


def _model_dir(expected_model: str) -> Path:
    """A checkpoint directory, or a hub id already in the local Hugging Face cache (nothing is downloaded)."""
    if Path(expected_model).is_dir():
        return Path(expected_model)
    from huggingface_hub import snapshot_download

    try:
        return Path(
            snapshot_download(expected_model, local_files_only=True, allow_patterns=["*.json", "*.safetensors"])
        )
    except Exception:  # the hub client raises several kinds for "not cached" and "not a repo id"
        raise ArtifactError(
            f"{expected_model!r} is neither a checkpoint directory nor in the local Hugging Face cache; "
            "pass the directory whose routers to fingerprint"
        ) from None


def _check_model(meta: dict, expected_model: str, problems: list[str]) -> None:
    from transformers import AutoConfig

    try:
        model_dir = _model_dir(expected_model)
        register_model_aliases()
        model_type = AutoConfig.from_pretrained(str(model_dir), trust_remote_code=False).model_type
        # routed with another family's facts at collection (--adapter)? the same model is, here too
        adapter = meta.get("adapter") if model_type == meta.get("model_type") else None
        found = checkpoint_routers_sha256(model_dir, adapter)
    except (RpbError, OSError, ValueError) as e:
        problems.append(f"model: {e}")
        return
    mismatches = model_mismatches(
        meta, model=expected_model, routers_sha256=found.routers_sha256, top_k=found.top_k,
        moe_layers=found.moe_layers, num_experts=found.num_experts,
    )  # fmt: skip
    for name, old, new in mismatches:
        if name == "model":
            problems.append(f"model: the prior was collected on {old!r}, whose routers differ from {new!r}'s")
        else:
            problems.append(f"model: {name}: the prior has {old!r}, {expected_model!r} has {new!r}")


def validate_artifact(
    path: str | Path,
    data_jsonl: str | Path | None = None,
    expected_model: str | None = None,
    expected_layers: int | None = None,
    expected_experts: int | None = None,
    expected_template_kwargs: dict | None = None,
) -> ValidationReport:
    report = ValidationReport(str(path))
    problems = report.problems
    try:
        art = load_artifact(path)
    except (ArtifactError, OSError) as e:
        problems.append(str(e))
        return report
    meta = art.metadata
    _check_metadata(meta, problems)
    _check_tensors(art, meta, problems)
    if data_jsonl is not None:
        _check_data(art, meta, Path(data_jsonl), problems)
    if expected_model is not None:
        _check_model(meta, expected_model, problems)
    if expected_template_kwargs is not None and meta.get("chat_template_kwargs") != expected_template_kwargs:
        problems.append(
            f"chat_template_kwargs: the prior was collected with {meta.get('chat_template_kwargs')!r}, "
            f"expected {expected_template_kwargs!r} (another value renders other tokens: recollect)"
        )
    if expected_layers is not None and art.prior_qa.dim() == 4 and art.prior_qa.shape[2] != expected_layers:
        problems.append(f"layers: the prior has {art.prior_qa.shape[2]} MoE layers, expected {expected_layers}")
    if expected_experts is not None and art.prior_qa.dim() == 4 and art.prior_qa.shape[3] != expected_experts:
        problems.append(f"experts: the prior has {art.prior_qa.shape[3]} experts, expected {expected_experts}")
    if report.ok:
        entropy_SL = utilization_entropy_bits(art.prior_qa)
        report.summary = {
            "samples": art.num_rows,
            "layers": art.prior_qa.shape[2],
            "experts": art.prior_qa.shape[3],
            "moe_layers": meta["moe_layers"],
            "router_transform": meta["router_transform"],
            "top_k": meta["top_k"],
            "entropy_q_bits": entropy_SL[0].tolist(),
            "entropy_a_bits": entropy_SL[1].tolist(),
        }
    return report
