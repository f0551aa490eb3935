"""Checkpoints that survive preemption: a marker written last, and a resume that checks the set-up.

``rpb train`` with ``train.save_every: N`` saves the Trainer's checkpoint (weights, optimizer,
scheduler, RNG states, data position) every N steps into ``output_dir/checkpoint-<step>/``;
``CompleteMarker`` then writes ``rpb_checkpoint.json`` into it, atomically and last, so a
checkpoint a kill interrupted has no marker and is never resumed from.

``train.resume_from_checkpoint: auto`` takes the newest checkpoint with a marker (none: a fresh
start); a path must hold one. The marker records what the run was (the base model's routers, the
prior file, the data file, the anchor and LoRA settings); a resume where any of them differ is
refused, naming the field. The loss anchors' frozen base router and the ``within-*`` controls'
communities come from the base model ``rpb train`` loads (``model``, which the prior's router
fingerprint pins), never from the weights being resumed: the anchor is installed on the base
before the Trainer loads the checkpoint into it.
"""

from __future__ import annotations

import dataclasses
import json
import re
from pathlib import Path

from transformers import TrainerCallback

from rpb.errors import RpbError
from rpb.fileio import write_json_atomic, write_text_atomic

MARKER = "rpb_checkpoint.json"
_CHECKPOINT = re.compile(r"checkpoint-(\d+)$")


class ResumeError(RpbError):
    """The checkpoint to resume from is incomplete, missing, or belongs to another set-up."""


def run_record(
    cfg, *, base_routers_sha256: str, data_sha256: str, prior_sha256: str | None, data_mix: dict | None = None
) -> dict:
    """What a resumed run must share with the interrupted one (``data_mix``: ``data.mix``'s record, whose files
    and order it must share too)."""
    mixed = {}
    if data_mix:
        files = [[s["path"], s["sha256"]] for s in data_mix["sources"][1:]]
        mixed = {"mix": {"files": files, "order_sha256": data_mix["order_sha256"]}}
    return {
        "base": {"model": cfg.model, "routers_sha256": base_routers_sha256},
        "prior": {"path": cfg.prior, "sha256": prior_sha256},
        "data": {"path": cfg.data_jsonl, "sha256": data_sha256, **mixed},
        "method": _method_record(cfg.anchor),
        "lora": dataclasses.asdict(cfg.lora),
    }


#: how checkpoints written while ids alone defaulted to set-ce recorded anchor.routes_loss left unset; a checkpoint
#: now records the default it resolved for its file (``default: bucket`` or ``default: hinge``)
ROUTES_DEFAULT_BEFORE_HINGE = "default: bucket with probabilities, set-ce with ids alone"
#: the anchor fields only routing-kd and output-kd read (``rpb.teacher``)
TEACHER_FIELDS = ("base", "routes", "base_dtype", "trained_base", "routes_loss")


def _method_record(anchor) -> dict:
    """The anchor's settings a resumed run must share: the base's fields only where the method reads a base (so a
    checkpoint written before they existed still resumes), and a route file by its sha256 (it may move; what it
    holds may not)."""
    from rpb.anchors import METHODS

    record = dataclasses.asdict(anchor)
    for name in ("trained_base", "target"):  # recorded only where set, as checkpoints written before them had none
        if not record.get(name):
            record.pop(name, None)
    method = METHODS.get(anchor.method)
    if method is None or method.teacher is None:
        return {k: v for k, v in record.items() if k not in TEACHER_FIELDS}
    if record.get("routes"):
        from rpb.replay.routeshards import routes_sha256

        record["routes"] = routes_sha256(record["routes"])
    if record.get("base") == "routes":
        # the stored-routes form by name, its default included: a checkpoint written before the bucket form became
        # the default for files with probabilities has none, and is not resumed under another term
        record["routes_loss"] = anchor.routes_loss or f"default: {_default_form(anchor.routes)}"
    else:
        record.pop("routes_loss", None)
    return record


def _default_form(routes: str) -> str:
    """The form ``anchor.routes_loss`` left unset gives the route file: ``bucket`` where it holds probabilities,
    ``hinge`` where it holds ids alone (its header read, not its tensors)."""
    from rpb.losses import routes_loss_form
    from rpb.replay.routeshards import open_routes

    return routes_loss_form(None, open_routes(routes).has_probs)


def _as_now(saved: dict, record: dict) -> dict:
    """A checkpoint's method record read as today's: ``ROUTES_DEFAULT_BEFORE_HINGE`` meant bucket for a file with
    probabilities and set-ce for ids alone, and the record pins the file, so today's resolved default says which."""
    if saved.get("routes_loss") != ROUTES_DEFAULT_BEFORE_HINGE:
        return saved
    then = "default: bucket" if record.get("routes_loss") == "default: bucket" else "default: set-ce"
    return {**saved, "routes_loss": then}


class CompleteMarker(TrainerCallback):
    """After the Trainer has written a checkpoint: its marker, last (main process)."""

    def __init__(self, record: dict):
        self.record = record

    def on_save(self, args, state, control, **kwargs):
        if state.is_world_process_zero:
            where = Path(args.output_dir) / f"checkpoint-{state.global_step}"
            write_json_atomic(where / MARKER, {"step": state.global_step, **self.record})


def complete_checkpoints(output_dir: str | Path) -> list[Path]:
    """The checkpoints a kill did not interrupt, oldest first."""
    found = []
    for d in Path(output_dir).glob("checkpoint-*"):
        m = _CHECKPOINT.search(d.name)
        if m and d.is_dir() and (d / MARKER).is_file():
            found.append((int(m.group(1)), d))
    return [d for _, d in sorted(found)]


def resolve_resume(output_dir: str | Path, spec: str | None, record: dict) -> str | None:
    """The checkpoint to resume from (None: start fresh), after checking its record against ``record``."""
    if not spec:
        return None
    if spec == "auto":
        done = complete_checkpoints(output_dir)
        if not done:
            return None
        path = done[-1]
    else:
        path = Path(spec)
        if not (path / MARKER).is_file():
            raise ResumeError(
                f"train.resume_from_checkpoint: {path} is not a complete rpb checkpoint (no {MARKER}: missing, or "
                "interrupted while it was written); use `auto` to take the newest complete one"
            )
    saved = json.loads((path / MARKER).read_text())
    if "method" in saved:
        saved["method"] = _as_now(saved["method"], record["method"])
    mismatches = [
        (f"{section}.{key}", saved.get(section, {}).get(key), value)
        for section in ("base", "prior", "data", "method", "lora")
        for key, value in record[section].items()
        # paths and model ids may move; what the files and weights are may not
        if key not in ("path", "model") and saved.get(section, {}).get(key) != value
    ]
    if mismatches:
        lines = "\n".join(
            f"  {name}: the checkpoint's run has {old!r}, this run has {new!r}" for name, old, new in mismatches
        )
        raise ResumeError(
            f"train.resume_from_checkpoint: {path} was written by another set-up ({len(mismatches)} field(s)):\n"
            f"{lines}\nresume with the run's own base, prior, data and anchor, or start a new output_dir"
        )
    return str(path)


def trim_log(log_path: Path, checkpoint: str) -> None:
    """Drop the log records the interrupted run wrote after ``checkpoint``: the resumed run writes them anew."""
    if not log_path.is_file():
        return
    step = int(_CHECKPOINT.search(Path(checkpoint).name).group(1))
    kept = [line for line in log_path.read_text().splitlines() if json.loads(line).get("step", 0) <= step]
    write_text_atomic(log_path, "".join(line + "\n" for line in kept))
