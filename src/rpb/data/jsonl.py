"""Reading JSONL rows into conversations, with every malformed row reported by line.

Two row forms are accepted:

* reference form ``{"input": str, "output": str}``: ``input`` is the rendered
  conversation up to the assistant body (the chat template's generation prompt
  included), ``output`` the assistant body and its turn end;
* messages form ``{"messages": [{"role": str, "content": str}, ...]}``, rendered by
  the tokenizer's own chat template; multi-turn is allowed.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass
from pathlib import Path

from rpb.data.errors import RowError, RowProblem
from rpb.errors import ArgumentError

Q_ROLES = ("user",)
A_ROLES = ("assistant",)


@dataclass(frozen=True)
class ReferenceRow:
    input: str
    output: str


@dataclass(frozen=True)
class MessagesRow:
    messages: tuple[dict, ...]


Row = ReferenceRow | MessagesRow


def require_file(path: str | Path) -> Path:
    """``path`` as a Path, or ArgumentError when no file is there."""
    path = Path(path)
    if not path.is_file():
        raise ArgumentError(f"{path}: no such file")
    return path


def file_sha256(path: str | Path) -> str:
    """sha256 of the file's bytes: the fingerprint that ties a prior to its data."""
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def split_lines(data: bytes) -> list[bytes]:
    """The file's rows: one per line; a final newline does not start another row."""
    lines = data.split(b"\n")
    if lines and lines[-1] == b"":
        lines.pop()
    return lines


def row_digests(path: str | Path) -> list[bytes]:
    """sha256 of each row's bytes (without its newline), in file order."""
    return [hashlib.sha256(line.rstrip(b"\r")).digest() for line in split_lines(Path(path).read_bytes())]


def parse_object(raw: bytes) -> dict:
    """One line as a JSON object, or a RowProblem saying why not (UnicodeDecodeError for bad UTF-8)."""
    text = raw.decode("utf-8", errors="strict").strip()
    if not text:
        raise RowProblem("blank", "blank line (rows may not be skipped, so blank lines are errors)")
    try:
        obj = json.loads(text)
    except json.JSONDecodeError as e:
        raise RowProblem("malformed-json", f"not valid JSON: {e.msg} at column {e.colno}") from None
    if not isinstance(obj, dict):
        raise RowProblem("malformed-json", f"expected a JSON object, got {type(obj).__name__}")
    where = _surrogate_at(obj, "")
    if where is not None:
        raise RowProblem(
            "invalid-text",
            "a string holds a lone UTF-16 surrogate (a \\ud800-\\udfff escape without its pair): not text, "
            "and no tokenizer can encode it",
            field=where or None,
        )
    return obj


def _surrogate_at(value, path: str) -> str | None:
    """The field path of the first string (or key) holding a lone surrogate, or None."""
    if isinstance(value, str):
        return path if any("\ud800" <= c <= "\udfff" for c in value) else None
    if isinstance(value, dict):
        for k, v in value.items():
            inner = f"{path}.{k}" if path else str(k)
            found = _surrogate_at(k, inner) if any("\ud800" <= c <= "\udfff" for c in k) else _surrogate_at(v, inner)
            if found is not None:
                return found
    if isinstance(value, list):
        for i, v in enumerate(value):
            found = _surrogate_at(v, f"{path}[{i}]")
            if found is not None:
                return found
    return None


def parse_row(raw: bytes) -> Row:
    obj = parse_object(raw)
    if "messages" in obj:
        return _messages_row(obj["messages"])
    if "input" in obj or "output" in obj:
        for key in ("input", "output"):
            if key not in obj:
                raise RowProblem("missing-field", f"reference-form row has no {key!r}", field=key)
            if not isinstance(obj[key], str):
                raise RowProblem("non-string-field", f"{key!r} must be a string, got {type(obj[key]).__name__}", key)
        return ReferenceRow(obj["input"], obj["output"])
    raise RowProblem(
        "missing-field",
        f"row has neither 'messages' nor 'input'/'output' (keys: {sorted(obj)})",
        field="messages",
    )


def _messages_row(messages: object) -> MessagesRow:
    if not isinstance(messages, list) or not messages:
        raise RowProblem("malformed-messages", "'messages' must be a non-empty list", field="messages")
    for i, m in enumerate(messages):
        field = f"messages[{i}]"
        if not isinstance(m, dict):
            raise RowProblem("malformed-messages", f"expected an object, got {type(m).__name__}", field)
        for key in ("role", "content"):
            if key not in m:
                raise RowProblem("missing-field", f"message has no {key!r}", f"{field}.{key}")
            if not isinstance(m[key], str):
                raise RowProblem(
                    "non-string-field", f"{key!r} must be a string, got {type(m[key]).__name__}", f"{field}.{key}"
                )
    roles = [m["role"] for m in messages]
    if not any(r in Q_ROLES for r in roles):
        raise RowProblem("empty-q-span", "conversation has no user message", field="messages")
    if not any(r in A_ROLES for r in roles):
        raise RowProblem("empty-a-span", "conversation has no assistant message", field="messages")
    return MessagesRow(tuple(dict(m) for m in messages))


def read_jsonl(path: str | Path) -> tuple[list[Row | None], list[RowError]]:
    """Parse every row. Returns rows (None where bad) and the errors, in file order."""
    rows: list[Row | None] = []
    errors: list[RowError] = []
    for line_no, raw in enumerate(split_lines(require_file(path).read_bytes()), start=1):
        try:
            rows.append(parse_row(raw))
        except UnicodeDecodeError as e:
            rows.append(None)
            errors.append(RowError(line_no, "malformed-json", f"not UTF-8: {e.reason} at byte {e.start}"))
        except RowProblem as p:
            rows.append(None)
            errors.append(p.at(line_no))
    return rows, errors
