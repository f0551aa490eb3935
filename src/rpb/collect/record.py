"""What a collection's artifact says about its data, shared by both collectors (an HF forward's, an engine's
routes'): the data file checked row by row, and the metadata fields that describe it and the template."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import rpb
from rpb.collect.rows import KEEP_TOKENS, RowIndex, scan_rows
from rpb.data import ChatTemplate, note_truncated
from rpb.data.reasoning import note_reasoning
from rpb.prior import SPAN_NAMES
from rpb.prior.artifact import ROUTED_ALL_POSITIONS, SCHEMA, SCHEMA_VERSION


@dataclass
class ScannedData:
    """A data file checked and indexed (``rows``), the template it was labelled with, and the artifact's fields
    about both (``run``; the model's fields are the collector's to add)."""

    rows: RowIndex
    template: ChatTemplate
    run: dict


def scan_data(
    data_jsonl: str | Path,
    tokenizer,
    *,
    model_id: str,
    tokenizer_id: str,
    max_seq_len: int,
    top_k: int,
    router_transform: str,
    prior_kind: str,
    dtype: str,
    chat_template_kwargs: dict | None = None,
) -> ScannedData:
    """Every row of ``data_jsonl`` labelled and checked (all bad rows refused at once, ``DataError``) before any
    compute, and the metadata that describes the collection."""
    template = ChatTemplate(tokenizer, chat_template_kwargs)
    rows = scan_rows(data_jsonl, template, max_seq_len, KEEP_TOKENS)
    reasoning = template.reasoning.as_dict()  # the scan's count (chunks label their rows again)
    note_reasoning(reasoning, template.settings)
    note_truncated(template.truncated_rows, rows.num_rows, max_seq_len)  # the scan's count, as reasoning's
    run = {
        "schema": SCHEMA,
        "schema_version": SCHEMA_VERSION,
        "rpb_version": rpb.__version__,
        "model": str(model_id),
        "tokenizer": str(tokenizer_id),
        "chat_template_sha256": template.sha256,
        **template.settings,
        "reasoning": reasoning,
        "truncated_rows": template.truncated_rows,
        "router_transform": router_transform,
        "prior_kind": prior_kind,
        "top_k": int(top_k),
        "max_seq_len": int(max_seq_len),
        "routed_positions": ROUTED_ALL_POSITIONS,
        "num_rows": rows.num_rows,
        "num_tokens": rows.num_tokens,
        "data_sha256": rows.sha256,
        "data_file": Path(data_jsonl).name,
        "spans": list(SPAN_NAMES),
        "dtype": dtype,
    }
    return ScannedData(rows, template, run)
