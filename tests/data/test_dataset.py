"""Every kind of bad row gets its own named error with its line number, all reported together,
before any model compute, and no artifact is written."""

import json

import pytest

from rpb.cli import main
from rpb.data import DataError, load_labelled
from tests.conftest import qa, write_rows

GOOD = qa("What is 1 + 1?", "2")
LONG_SYSTEM = {
    "messages": [
        {"role": "system", "content": "s" * 100},
        {"role": "user", "content": "q"},
        {"role": "assistant", "content": "a"},
    ]
}
BAD_ROWS = [
    (json.dumps(GOOD), None),
    ("", "blank"),
    ('{"messages": [', "malformed-json"),
    ("[1, 2]", "malformed-json"),
    (json.dumps({"input": "<|im_user|>user<|im_middle|>hi"}), "missing-field"),
    (
        json.dumps({"messages": [{"role": "user", "content": 5}, {"role": "assistant", "content": "a"}]}),
        "non-string-field",
    ),
    (json.dumps({"input": "What is 2+2?", "output": "4"}), "marker-free"),
    (json.dumps(LONG_SYSTEM), "empty-q-span"),  # the user turn lies beyond max_seq_len
    (json.dumps(qa("q" * 100, "a")), "empty-a-span"),  # the answer lies beyond max_seq_len
    (json.dumps({"messages": [{"role": "user", "content": "only a question"}]}), "empty-a-span"),
    (json.dumps({"messages": [{"role": "user"}, {"role": "assistant", "content": "a"}]}), "missing-field"),
    (json.dumps({"question": "q", "answer": "a"}), "missing-field"),
    (json.dumps(GOOD), None),
]
MAX_LEN = 96


@pytest.fixture
def bad_file(tmp_path):
    return write_rows(tmp_path / "bad.jsonl", [row for row, _ in BAD_ROWS])


def test_every_bad_row_is_named_with_its_line(bad_file, moon_tok):
    with pytest.raises(DataError) as err:
        load_labelled(bad_file, moon_tok, MAX_LEN)
    expected = [(line, kind) for line, (_, kind) in enumerate(BAD_ROWS, start=1) if kind]
    assert [(e.line, e.kind) for e in err.value.errors] == expected
    text = str(err.value)
    for line, kind in expected:
        assert f"{bad_file}:{line}: {kind}" in text
    assert "[messages[0].content]" in text  # the field is named


def test_cli_reports_all_rows_and_writes_nothing_before_loading_the_model(bad_file, save_tiny, tmp_path, capsys):
    out = tmp_path / "prior.safetensors"
    code = main(
        [
            "collect",
            "--model",
            str(tmp_path / "no-such-model"),
            "--tokenizer",
            str(save_tiny("moonlight")),
            "--data-jsonl",
            str(bad_file),
            "--out-path",
            str(out),
            "--top-k",
            "2",
            "--max-seq-len",
            str(MAX_LEN),
            "--no-progress",
        ]
    )
    err = capsys.readouterr().err
    assert code == 2
    assert "11 bad row(s)" in err and "no-such-model" not in err  # the model was never touched
    assert not out.exists() and list(tmp_path.glob("*.safetensors*")) == []


def test_empty_file_is_an_error(tmp_path, moon_tok):
    empty = tmp_path / "empty.jsonl"
    empty.write_text("")
    with pytest.raises(DataError, match="no rows"):
        load_labelled(empty, moon_tok, MAX_LEN)


def test_token_sha256_is_the_documented_bytes():
    """Each list as its int64 count then its int64 values, little-endian, written out byte by byte."""
    import hashlib

    from rpb.data import Example

    e = Example(3, [5, 258], [-1, 1])
    raw = (b"\x02" + b"\x00" * 7 + b"\x05" + b"\x00" * 7 + b"\x02\x01" + b"\x00" * 6
           + b"\x02" + b"\x00" * 7 + b"\xff" * 8 + b"\x01" + b"\x00" * 7)  # fmt: skip
    assert e.token_sha256 == hashlib.sha256(raw).hexdigest()
    assert Example(3, [5, 258], [-1, 0]).token_sha256 != e.token_sha256  # a span id alone changes it
    assert Example(9, [5, 258], [-1, 1]).token_sha256 == e.token_sha256  # the row's tokens, not its position


def test_a_file_labelled_once_is_not_labelled_again_unless_what_decides_its_labels_changed(
    tmp_path, moon_tok, chatml_tok, monkeypatch
):
    from rpb.data import dataset

    calls = []
    label = dataset.label_row
    monkeypatch.setattr(dataset, "label_row", lambda *a: calls.append(1) or label(*a))
    monkeypatch.setattr(dataset, "_LABELLED", type(dataset._LABELLED)())
    rows = [qa("What is 1 + 1?", "2"), qa("What is 2 + 3?", "5")]
    path = write_rows(tmp_path / "a.jsonl", rows)
    first = load_labelled(path, moon_tok, 256)
    assert len(calls) == 2
    again = load_labelled(path, moon_tok, 256)
    assert len(calls) == 2 and again == first  # the same labels, not relabelled
    copy = write_rows(tmp_path / "copy.jsonl", rows)
    assert load_labelled(copy, moon_tok, 256).path == str(copy) and len(calls) == 2  # the same bytes elsewhere
    for changed in (
        lambda: load_labelled(write_rows(tmp_path / "a.jsonl", [*rows, qa("And 3 + 3?", "6")]), moon_tok, 256),
        lambda: load_labelled(path, moon_tok, 200),  # max_seq_len
        lambda: load_labelled(path, chatml_tok, 256),  # another tokenizer and template
        lambda: load_labelled(path, moon_tok, 256, date="2026-01-01"),  # the day the template sees
    ):
        before = len(calls)
        data = changed()
        assert len(calls) > before and data.examples
    assert len(dataset._LABELLED) == dataset._LABELLED_KEEP


def test_an_empty_message_is_named_as_empty_not_as_a_span_cut_by_max_seq_len(tmp_path, moon_tok):
    from rpb.data import ChatTemplate

    prefix, rest = ChatTemplate(moon_tok).render_reference(
        [{"role": "user", "content": "q"}, {"role": "assistant", "content": ""}]
    )
    two_empty = [{"role": "user", "content": "q"}, {"role": "assistant", "content": ""},
                 {"role": "user", "content": "r"}, {"role": "assistant", "content": ""}]  # fmt: skip
    rows = [
        GOOD,
        qa("What is 1 + 1?", ""),
        qa("", "2"),
        {"input": prefix, "output": rest},
        {"messages": two_empty},
        {
            "messages": [
                {"role": "user", "content": "q"},
                {"role": "assistant", "content": "", "reasoning_content": "r"},
            ]
        },
    ]
    path = write_rows(tmp_path / "empty.jsonl", rows)
    with pytest.raises(DataError) as err:
        load_labelled(path, moon_tok, MAX_LEN)
    got = [(e.line, e.kind, e.field) for e in err.value.errors]
    assert got == [(2, "empty-a-span", "messages[1].content"), (3, "empty-q-span", "messages[0].content"),
                   (4, "empty-a-span", "output"), (5, "empty-a-span", "messages[1].content"),
                   (6, "empty-a-span", "messages[1].content")]  # fmt: skip
    said = [e.message for e in err.value.errors]
    assert said[0].startswith("message 1 (assistant) is empty") and said[1].startswith("message 0 (user) is empty")
    assert said[2].startswith("'output' holds an empty assistant body")
    assert "message 1 (assistant) is empty; message 3 (assistant) is empty" in said[3]
    assert "empty answer, and the chat template does not render its reasoning" in said[4]  # moonlight's drops it
    assert not any("max_seq_len" in s for s in said)  # nothing here is about truncation
    assert f"{path}:2: empty-a-span [messages[1].content]: message 1 (assistant) is empty" in str(err.value)


def _token_count(tok, row: dict) -> int:
    """The rendered row's tokens, counted from the tokenizer's own chat template and tokenizer."""
    text = tok.apply_chat_template(row["messages"], tokenize=False)
    return len(tok(text, add_special_tokens=False)["input_ids"])


def test_rows_longer_than_max_seq_len_are_counted(tmp_path, moon_tok):
    boundary = qa("How many legs has a spider?", "A spider has eight legs, " * 3)
    length = _token_count(moon_tok, boundary)
    short = [qa("What is 1 + 1?", "2"), qa("Name a colour.", "Blue."), qa("Hi", "Hello")]
    long = [qa("Say it often.", "again and again " * 40), qa("Count.", " ".join(str(i) for i in range(80)))]
    assert max(_token_count(moon_tok, r) for r in short) < length - 1
    assert min(_token_count(moon_tok, r) for r in long) > length
    path = write_rows(tmp_path / "long.jsonl", [short[0], long[0], boundary, short[1], long[1], short[2]])
    exact = load_labelled(path, moon_tok, length)  # the boundary row fits exactly: 2 cut
    assert exact.truncated_rows == 2 and [len(e) for e in exact.examples][1:3] == [length, length]
    assert load_labelled(path, moon_tok, length - 1).truncated_rows == 3  # one token shorter: it is cut too
    assert load_labelled(path, moon_tok, 4096).truncated_rows == 0
