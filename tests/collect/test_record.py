"""What both collectors record about the data: the fields, and every bad row refused before any compute."""

from __future__ import annotations

import pytest

from rpb.collect.record import scan_data
from rpb.data import DataError, load_labelled
from rpb.models import load_tokenizer
from rpb.testing.data import conversations, write_jsonl


def test_fields_and_refusals(replica, tmp_path):
    model_dir = replica("qwen3_30b_a3b")
    tokenizer = load_tokenizer(str(model_dir))
    data = write_jsonl(conversations(4, seed=2), tmp_path / "rows.jsonl")
    kw = dict(model_id="m", tokenizer_id="t", max_seq_len=512, top_k=8, router_transform="softmax", dtype="float32")
    got = scan_data(data, tokenizer, prior_kind="frequency", **kw)
    examples = load_labelled(str(data), tokenizer, 512).examples
    assert got.rows.num_rows == 4 and got.rows.num_tokens == sum(len(e) for e in examples)
    assert got.run["prior_kind"] == "frequency" and got.run["data_file"] == "rows.jsonl"
    assert got.run["model"] == "m" and got.run["tokenizer"] == "t" and got.run["top_k"] == 8
    bad = tmp_path / "bad.jsonl"
    bad.write_text(data.read_text() + "{not json\n" + '{"messages": []}\n')
    with pytest.raises(DataError) as err:
        scan_data(bad, tokenizer, prior_kind="probability", **kw)
    assert "2 bad row(s)" in str(err.value) and "bad.jsonl:5:" in str(err.value) and "bad.jsonl:6:" in str(err.value)
