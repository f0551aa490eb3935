"""Which model is the base: a folder ``rpb train`` wrote holds a fine-tuned model, not a base.

``routing-kd`` and ``output-kd`` hold the model to its own start (a frozen copy of ``model``, the model with its
adapters off, or route files made from it). Given a folder that an earlier ``rpb train`` saved (its ``rpb_run.json``
says so, and names the base it started from), that start is the fine-tuned model, and the run would hold what the
earlier run learned as if it were the base, without a word. Such a folder is refused as the base unless the run
says it means it (``anchor.trained_base: true``: continued training that holds the fine-tuned routing). The checks
that follow (the frozen copy's routers against the model's, a route file's fingerprint) compare routers only: a
model whose routers match the checkpoint's is taken as its base whatever else it carries.
"""

from __future__ import annotations

import json
from pathlib import Path

#: the file ``rpb train`` writes beside every model it saves
RUN_RECORD = "rpb_run.json"


def lineage_problems(model: str | None, trained_base: bool) -> list[str]:
    """Why ``model`` cannot be taken as the base (empty: it can): a folder ``rpb train`` wrote, unless
    ``trained_base``. A hub id or a folder without the record has no lineage to read."""
    record_path = Path(model) / RUN_RECORD if model else None
    if trained_base or record_path is None or not record_path.is_file():
        return []
    try:
        record = json.loads(record_path.read_text())
        started = record["config"]["model"]
        steps, method = record.get("global_step"), record.get("method", "?")
    except (OSError, ValueError, KeyError, TypeError) as e:
        return [f"model: {record_path} is not a readable rpb_run.json ({e}); cannot tell which model is the base"]
    return [
        f"model: {model} was saved by rpb train ({record_path}: {method}, {steps} step(s) from {started}): "
        f"as the base, the run would hold the fine-tuned routing. Give the base it started from (model={started}), "
        "or set anchor.trained_base=true to hold this model's own routing"
    ]
