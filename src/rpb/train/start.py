"""What ``rpb train`` writes to ``log.jsonl`` before the first step (rank 0): how far the run's bias moves the
base's own expert choice (``check_displacement``), and where routing-kd / output-kd read their base from
(``note_base``). Each is a ``step 0`` record, so a resumed or killed run's log still opens with them."""

from __future__ import annotations

import json
import logging
from pathlib import Path

from rpb.train.config import RunConfig

logger = logging.getLogger("rpb.train.run")


def _append(log_path: Path, record: dict) -> None:
    """One step-0 line at the end of ``log.jsonl`` (its folder made if need be)."""
    log_path.parent.mkdir(parents=True, exist_ok=True)
    with open(log_path, "a", encoding="utf-8") as f:
        f.write(json.dumps(record) + "\n")


def check_displacement(cfg: RunConfig, prepared, log_path: Path) -> float | None:
    """Before the first step (rank 0): how far this run's bias moves the base's own expert choice
    (``rpb.calibrate.startup``); logged to ``log.jsonl`` as ``calibrate/displacement`` (mean over MoE
    layers, and per layer), with a warning above ``train.displacement_warn``. None when off or moot."""
    from rpb.calibrate.startup import startup_displacement

    if not prepared.handle.method.needs_prior or cfg.train.calibrate_rows == 0:
        return None
    per_layer = startup_displacement(
        prepared.handle,
        prepared.model,
        prepared.dataset.examples,
        cfg.train.calibrate_rows,
        cfg.data.seed,
        cfg.train.batch_size,
        prepared.collator.pad_id,
    )
    mean = sum(per_layer) / len(per_layer)
    record = {"step": 0, "calibrate/displacement": round(mean, 5)}
    record |= {
        f"calibrate/displacement/layer{layer.moe.layer_index}": round(v, 5)
        for layer, v in zip(prepared.handle.layers, per_layer, strict=True)
    }
    _append(log_path, record)
    prepared.info["calibrate_displacement"] = {"mean": mean, "per_layer": per_layer}
    if mean > cfg.train.displacement_warn:
        logger.warning(
            "rpb: %s (anchor.beta=%g) moves %.0f%% of content tokens off the base's own expert choice before any "
            "training (mean over MoE layers; train.displacement_warn=%g): it will replace the base's routing with "
            "the span average rather than hold it. `rpb calibrate` measures other betas.",
            cfg.anchor.method,
            cfg.anchor.beta,
            100 * mean,
            cfg.train.displacement_warn,
        )
    return mean


def note_base(base: dict | None, log_path: Path) -> None:
    """routing-kd / output-kd's base, in the log before the first step: where it comes from and the memory a frozen
    copy takes beside the model (``base/copy_mib``)."""
    if not base:
        return
    record = {"step": 0, "base/source": base["source"]}
    if "copy_bytes" in base:
        record |= {"base/mode": base["mode"], "base/copy_mib": round(base["copy_bytes"] / 2**20, 3)}
    _append(log_path, record)
    if base.get("copy_bytes"):
        mib = base["copy_bytes"] / 2**20
        logger.warning("rpb: the online base is a frozen copy of the model: %.1f MiB beside it", mib)
