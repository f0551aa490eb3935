"""``rpb render``: question/answer rows -> reference-form rows, via the tokenizer's chat template."""

from __future__ import annotations

import json
from pathlib import Path

from rpb.data.errors import DataError, RowError, RowProblem
from rpb.data.jsonl import parse_object, require_file, split_lines
from rpb.data.template import ChatTemplate
from rpb.fileio import write_text_atomic


def _qa_messages(raw: bytes) -> list[dict]:
    obj = parse_object(raw)
    messages = []
    for key, role in (("system", "system"), ("question", "user"), ("answer", "assistant")):
        if key not in obj:
            if key == "system":
                continue
            raise RowProblem("missing-field", f"row has no {key!r}", field=key)
        if not isinstance(obj[key], str):
            raise RowProblem("non-string-field", f"{key!r} must be a string, got {type(obj[key]).__name__}", key)
        messages.append({"role": role, "content": obj[key]})
    return messages


def render_file(tokenizer, in_path: str | Path, out_path: str | Path) -> int:
    """Write ``{"input", "output"}`` rows for every ``{"question", "answer"[, "system"]}`` row.

    All bad rows are reported together and nothing is written when there is any;
    the output appears atomically. Returns the number of rows written.
    """
    template = ChatTemplate(tokenizer)
    out_rows, errors = [], []
    for line_no, raw in enumerate(split_lines(require_file(in_path).read_bytes()), start=1):
        try:
            prefix, rest = template.render_reference(_qa_messages(raw))
        except RowProblem as p:
            errors.append(p.at(line_no))
            continue
        except UnicodeDecodeError as e:
            errors.append(RowError(line_no, "malformed-json", f"not UTF-8: {e.reason}"))
            continue
        out_rows.append(json.dumps({"input": prefix, "output": rest}, ensure_ascii=False))
    if errors:
        raise DataError(str(in_path), errors)
    write_text_atomic(out_path, "".join(r + "\n" for r in out_rows))
    return len(out_rows)
