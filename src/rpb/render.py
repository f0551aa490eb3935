"""``rpb render``: question/answer rows -> reference-form rows, via the tokenizer's chat template."""

from __future__ import annotations

import json
import os
import tempfile
from pathlib import Path

from rpb.data.errors import DataError, RowError, RowProblem
from rpb.data.jsonl import parse_object, split_lines
from rpb.data.template import ChatTemplate


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
    for line_no, raw in enumerate(split_lines(Path(in_path).read_bytes()), start=1):
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
    out_path = Path(out_path)
    out_path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{out_path.name}.", suffix=".partial", dir=out_path.parent)
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as f:
            f.write("".join(r + "\n" for r in out_rows))
        os.replace(tmp, out_path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    return len(out_rows)
