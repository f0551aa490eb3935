"""Checks that a prior artifact is well-formed and belongs to the data and model at hand.

Every problem is collected (none stops the others from being checked); the caller
prints them all and exits non-zero when there is any. The file's own problems (metadata, tensors,
values, tensor hash) are ``rpb.prior.checks``', which every command that reads a prior refuses.
The model is judged as ``rpb train`` judges it (``rpb.anchors.verify.model_mismatches``): by its
routers' fingerprint, top-k, MoE layers and experts, read from the checkpoint's safetensors shards
without loading it.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from pathlib import Path

import torch

from rpb.adapters import checkpoint_routers_sha256
from rpb.adapters.aliases import register_model_aliases
from rpb.anchors.verify import model_mismatches
from rpb.collect.clip import clip_table, clipped_shares
from rpb.data.jsonl import file_sha256, row_digests
from rpb.errors import RpbError
from rpb.prior.artifact import TENSORS_SHA256, ArtifactError, load_artifact, prior_kind_of
from rpb.prior.checks import file_problems, format_problems
from rpb.retention.metrics import entropy_bits

#: what a frequency prior is, where a report names its kind
FREQUENCY_NOTE = " (an engine's selection frequency, not the router's probability)"


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
            return format_problems(self.path, self.problems)
        s = self.summary
        hashed = f"  tensor bytes match {TENSORS_SHA256}"
        if not s["tensors_sha256"]:
            hashed = f"  schema {s['schema_version']}: no {TENSORS_SHA256}, the tensor bytes are not checked by hash"
        lines = [
            f"{self.path}: OK",
            f"  samples {s['samples']}, MoE layers {s['layers']} (model layers {s['moe_layers']}), "
            f"experts {s['experts']}, transform {s['router_transform']}, top-k {s['top_k']}",
            f"  prior kind {s['prior_kind']}" + (FREQUENCY_NOTE if s["prior_kind"] == "frequency" else ""),
            hashed,
            f"  per-layer utilization entropy (bits; max log2 E = {math.log2(s['experts']):.3f}), Q / A:",
        ]
        for layer, hq, ha in zip(s["moe_layers"], s["entropy_q_bits"], s["entropy_a_bits"], strict=True):
            lines.append(f"    layer {layer:3d}: {hq:.3f} / {ha:.3f}")
        share_SL = torch.tensor(s["clipped_share"])
        lines += ["  " + line for line in clip_table(share_SL, s["moe_layers"], s["prior_kind"]).splitlines()]
        return "\n".join(lines)


def utilization_entropy_bits(prior_NSLE: torch.Tensor) -> torch.Tensor:
    """Entropy (bits) of the mean prior over samples, per span and layer: ``[S, L]``."""
    return entropy_bits(prior_NSLE.double().mean(dim=0))


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


def model_dir_of(expected_model: str) -> Path:
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


def check_model(meta: dict, expected_model: str, problems: list[str]) -> None:
    """The prior's model fields (routers fingerprint, top-k, MoE layers, experts) against the checkpoint's files:
    its router tensors alone, memory-mapped; the model is never loaded."""
    from transformers import AutoConfig

    try:
        model_dir = model_dir_of(expected_model)
        register_model_aliases()
        model_type = AutoConfig.from_pretrained(str(model_dir), trust_remote_code=False).model_type
        # routed with another family's facts at collection (--adapter)? the same model is, here too
        adapter = meta.get("adapter") if model_type == meta.get("model_type") else None
        found = checkpoint_routers_sha256(model_dir, adapter)
    except (RpbError, OSError, ValueError) as e:
        problems.append(f"model: {e}")
        return
    mismatches = model_mismatches(
        meta,
        model=expected_model,
        routers_sha256=found.routers_sha256,
        top_k=found.top_k,
        moe_layers=found.moe_layers,
        num_experts=found.num_experts,
    )
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
    problems += file_problems(path, art)
    if data_jsonl is not None:
        _check_data(art, meta, Path(data_jsonl), problems)
    if expected_model is not None:
        check_model(meta, expected_model, problems)
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
            "prior_kind": prior_kind_of(meta),
            "top_k": meta["top_k"],
            "schema_version": meta["schema_version"],
            "tensors_sha256": TENSORS_SHA256 in meta,
            "entropy_q_bits": entropy_SL[0].tolist(),
            "entropy_a_bits": entropy_SL[1].tolist(),
            "clipped_share": clipped_shares(art.prior_qa).tolist(),
        }
    return report
