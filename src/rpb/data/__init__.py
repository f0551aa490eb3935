"""Training data: JSONL rows, chat-template rendering, Q/A/structural token labels, batches.

``jsonl`` parses rows, ``template`` finds the Q/A content through the chat template, ``tokens``
labels every token, ``dataset`` turns a file into examples, ``batches`` makes training batches that
carry each token's (sample, span), ``render`` writes reference-form rows.

The row's 0-based index in the file is its sample index everywhere. Rows are never
skipped, filtered or reordered: every problem is collected and reported together
(``DataError``) before any model compute.
"""

from rpb.data.batches import IGNORE_INDEX, LOSS_ON, AnchorCollator, ExampleDataset, LossOn, answer_mask, labels_for
from rpb.data.dataset import Example, LabelledData, collate, load_labelled, note_truncated
from rpb.data.errors import DataError, RowError
from rpb.data.jsonl import file_sha256, read_jsonl
from rpb.data.template import ChatTemplate

__all__ = [
    "IGNORE_INDEX",
    "LOSS_ON",
    "AnchorCollator",
    "ChatTemplate",
    "DataError",
    "Example",
    "ExampleDataset",
    "LabelledData",
    "LossOn",
    "RowError",
    "answer_mask",
    "collate",
    "file_sha256",
    "labels_for",
    "load_labelled",
    "note_truncated",
    "read_jsonl",
]
