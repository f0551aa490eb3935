"""Training data: JSONL rows, chat-template rendering, Q/A/structural token labels, batches.

The row's 0-based index in the file is its sample index everywhere. Rows are never
skipped, filtered or reordered: every problem is collected and reported together
(``DataError``) before any model compute.
"""

from rpb.data.dataset import Example, LabelledData, collate, load_labelled
from rpb.data.errors import DataError, RowError
from rpb.data.jsonl import file_sha256, read_jsonl
from rpb.data.template import ChatTemplate

__all__ = [
    "ChatTemplate",
    "DataError",
    "Example",
    "LabelledData",
    "RowError",
    "collate",
    "file_sha256",
    "load_labelled",
    "read_jsonl",
]
