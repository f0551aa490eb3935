"""Property tests of the JSONL reader: whatever bytes a data file holds, reading and labelling it ends in the
rows or in one ``DataError`` naming the file and, for every bad row, its line and kind -- never a traceback."""

from __future__ import annotations

import json
import tempfile
from pathlib import Path

import pytest
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

from rpb.data import DataError, load_labelled
from rpb.data.jsonl import read_jsonl, split_lines
from rpb.testing.tokenizers import moonlight_tokenizer

TOKENIZER = moonlight_tokenizer()
FUZZ = settings(max_examples=200, derandomize=True, deadline=None, suppress_health_check=[HealthCheck.too_slow])
GOOD = {"messages": [{"role": "user", "content": "What is 2+2?"}, {"role": "assistant", "content": "4"}]}

json_values = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats() | st.text(max_size=20),
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=8), inner, max_size=4),
    max_leaves=12,
)
message = st.fixed_dictionaries(
    {"role": st.sampled_from(["user", "assistant", "system", "tool", "robot", 3, None]),
     "content": st.one_of(st.text(max_size=40), json_values)},
    optional={"reasoning_content": json_values | st.text(max_size=10), "thinking": st.text(max_size=10),
              "channel": st.sampled_from(["analysis", "final", "commentary"])},
)  # fmt: skip
row = st.one_of(
    st.fixed_dictionaries({"messages": st.lists(message, max_size=5)}),
    st.fixed_dictionaries({"input": json_values, "output": json_values}),
    json_values,
)
# a line: a JSON row, possibly cut short, with a BOM or CR, or raw bytes (bad UTF-8 included)
line = st.one_of(
    row.map(lambda r: json.dumps(r).encode()),
    row.map(lambda r: json.dumps(r, ensure_ascii=False).encode("utf-8", "surrogatepass")),
    st.tuples(row, st.integers(0, 60)).map(lambda t: json.dumps(t[0]).encode()[: t[1]]),
    st.just(json.dumps(GOOD).encode()),
    st.just(b'{"messages": [{"role": "user", "content": "\\ud800"}, {"role": "assistant", "content": "x"}]}'),
    st.binary(max_size=40),
)
conversation = st.lists(st.text(min_size=1, max_size=30), min_size=2, max_size=4).map(
    lambda texts: {"messages": [{"role": ("user", "assistant")[i % 2], "content": t} for i, t in enumerate(texts)]}
)
files = st.tuples(
    st.one_of(st.lists(line, max_size=6), st.lists(conversation.map(lambda r: json.dumps(r).encode()), max_size=4)),
    st.sampled_from([b"\n", b"\r\n"]),
    st.booleans(),  # a BOM first
    st.booleans(),  # a final newline
)


def _write(parts) -> Path:
    lines, newline, bom, final = parts
    data = (b"\xef\xbb\xbf" if bom else b"") + newline.join(lines) + (newline if final and lines else b"")
    path = Path(tempfile.mkdtemp()) / "rows.jsonl"
    path.write_bytes(data)
    return path


@FUZZ
@given(files)
@example(([b"\xef\xbb\xbf" + json.dumps(GOOD).encode()], b"\n", False, True))
@example(([b"x" * 200_000], b"\n", False, True))
def test_any_file_is_labelled_or_refused_with_every_bad_line_named(parts):
    path = _write(parts)
    n_lines = len(split_lines(path.read_bytes()))
    try:
        data = load_labelled(path, TOKENIZER, 512)
    except DataError as e:
        assert str(path) in str(e)
        assert e.errors and all(1 <= err.line <= max(n_lines, 1) and err.kind for err in e.errors)
        assert [err.line for err in e.errors] == sorted(err.line for err in e.errors)
    else:
        assert [ex.index for ex in data.examples] == list(range(n_lines))  # no row skipped or reordered
    rows, errors = read_jsonl(path)
    assert len(rows) == n_lines and {e.line for e in errors} == {i + 1 for i, r in enumerate(rows) if r is None}


def test_an_empty_file_is_refused_by_name(tmp_path):
    path = tmp_path / "empty.jsonl"
    path.write_bytes(b"")
    with pytest.raises(DataError, match="empty-file"):
        load_labelled(path, TOKENIZER, 512)


def test_a_lone_surrogate_is_named_with_its_field(tmp_path):
    """JSON can escape half a UTF-16 pair; no tokenizer can encode the string it decodes to (found by the fuzz)."""
    path = tmp_path / "rows.jsonl"
    path.write_text(json.dumps(GOOD) + "\n" + json.dumps(GOOD).replace("4", "\\udc80") + "\n")
    with pytest.raises(DataError) as err:
        load_labelled(path, TOKENIZER, 512)
    (only,) = err.value.errors
    assert (only.line, only.kind, only.field) == (2, "invalid-text", "messages[1].content")
