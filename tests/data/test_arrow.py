"""rpb's labelled rows as a datasets.Dataset (the form TRL and axolotl take)."""

from __future__ import annotations

import datasets
import pytest

from rpb.data import Example
from rpb.data.arrow import as_dataset
from rpb.data.batches import IGNORE_INDEX
from rpb.errors import ConfigError

A, Q, S = 1, 0, -1  # span ids: answer, question, structural


def test_rows_keep_their_jsonl_index_and_spans_and_answer_labels():
    examples = [Example(7, [5, 6, 7, 8], [S, Q, A, A]), Example(2, [9, 10], [Q, A])]
    rows = as_dataset(examples)
    assert rows["sample_index"] == [7, 2]  # the JSONL row, not the position
    assert rows["span_ids"] == [[S, Q, A, A], [Q, A]]
    assert rows["labels"][0] == [IGNORE_INDEX, IGNORE_INDEX, 7, 8]
    assert as_dataset(examples, "all")["labels"][0] == [5, 6, 7, 8]


def test_a_dataset_without_rpbs_columns_is_refused_naming_them():
    with pytest.raises(ConfigError, match=r"lacks the column\(s\) \['span_ids', 'sample_index'\]"):
        as_dataset(datasets.Dataset.from_dict({"input_ids": [[1]], "labels": [[1]]}))
    with pytest.raises(ConfigError, match="must be rpb's labelled rows"):
        as_dataset([{"input_ids": [1]}])
