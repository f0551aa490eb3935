"""The data file for a streamed collection: one checking pass, then rows read back by range.

``load_labelled`` keeps every tokenized row in memory (tens of bytes per token as Python
lists: 20k rows of 8k tokens are gigabytes per process). The collector instead scans the
file once, labelling every row so that all bad rows are still reported together before any
compute, and keeps only each row's byte offset and sha256 (40 bytes a row); a chunk's rows
are read back and labelled again when the chunk runs. A file of at most ``KEEP_TOKENS`` tokens keeps
its labelled rows from the scan instead (labelling is single-threaded Python: 5-6 s for 20,000 short
conversations). Row semantics are ``read_jsonl``'s and
``load_labelled``'s: one row per ``\\n``-terminated line, a final newline starts no row,
nothing is skipped or reordered.
"""

from __future__ import annotations

import hashlib
from array import array
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import BinaryIO

import torch

from rpb.data import ChatTemplate, DataError, Example
from rpb.data.dataset import label_row
from rpb.data.errors import RowError, RowProblem
from rpb.data.jsonl import parse_row, require_file
from rpb.errors import ArgumentError


@dataclass(frozen=True)
class RowIndex:
    """Where each row of a checked data file lies, and its fingerprint."""

    path: Path
    sha256: str  # of the file's bytes
    offsets: array  # 'q': byte offset of each row's line
    digests: bytes  # sha256 of each row's bytes (without its newline), 32 bytes a row
    num_tokens: int | None  # after truncation, over all rows (None: indexed only, not labelled: ``index_rows``)
    #: every row labelled by the scan, when the file is small enough to keep them (``scan_rows``' ``keep_tokens``)
    examples: tuple[Example, ...] | None = None

    @property
    def num_rows(self) -> int:
        return len(self.offsets)

    def row_sha256(self, start: int, stop: int) -> torch.Tensor:
        """``row_sha256`` of rows ``[start, stop)``: uint8 ``[stop - start, 32]``."""
        return torch.frombuffer(bytearray(self.digests[32 * start : 32 * stop]), dtype=torch.uint8).view(-1, 32)


def _lines(f: BinaryIO, file_hash) -> Iterator[tuple[int, bytes]]:
    """(byte offset, line without its ``\\n``) of every row; feeds every byte to ``file_hash``."""
    offset = 0
    for raw in f:  # a binary file iterates on b"\n" only, like split_lines
        file_hash.update(raw)
        yield offset, raw[:-1] if raw.endswith(b"\n") else raw
        offset += len(raw)


def _digest(line: bytes) -> bytes:
    return hashlib.sha256(line.rstrip(b"\r")).digest()  # as row_digests does


#: ``scan_rows`` keeps a file's labelled rows up to this many tokens (about 150 MB of Python lists), so that
#: a small file is not labelled twice (the toy world's 20,000 conversations: 0.9 M tokens, 5-6 s a labelling)
KEEP_TOKENS = 2_000_000


def scan_rows(path: str | Path, template: ChatTemplate, max_seq_len: int, keep_tokens: int = 0) -> RowIndex:
    """Check and label every row of ``path``; raise one DataError listing every bad row. The labelled rows
    are kept in the index (``examples``) while they hold at most ``keep_tokens`` tokens."""
    if max_seq_len < 2:
        raise ArgumentError(f"max_seq_len must be >= 2, got {max_seq_len}")
    path = require_file(path)
    file_hash = hashlib.sha256()
    offsets, digests, errors, tokens = array("q"), bytearray(), [], 0
    kept: list[Example] | None = [] if keep_tokens > 0 else None
    with open(path, "rb") as f:
        for line_no, (offset, line) in enumerate(_lines(f, file_hash), start=1):
            offsets.append(offset)
            digests += _digest(line)
            try:
                ids, spans = label_row(template, parse_row(line), max_seq_len)
                tokens += len(ids)
                if kept is not None:
                    kept.append(Example(line_no - 1, ids, spans))
                    kept = kept if tokens <= keep_tokens else None  # too big to keep: read back by chunk
            except UnicodeDecodeError as e:
                errors.append(RowError(line_no, "malformed-json", f"not UTF-8: {e.reason} at byte {e.start}"))
            except RowProblem as p:
                errors.append(p.at(line_no))
    if not offsets:
        errors.append(RowError(1, "empty-file", "the data file has no rows"))
    if errors:
        raise DataError(str(path), errors)
    return RowIndex(
        path, file_hash.hexdigest(), offsets, bytes(digests), tokens, tuple(kept) if kept is not None else None
    )


def index_rows(path: str | Path) -> RowIndex:
    """Where each row of ``path`` lies, without labelling any: for a file already checked, such as the one a
    prior was collected from (compare ``sha256`` with the prior's ``data_sha256``)."""
    path = require_file(path)
    file_hash = hashlib.sha256()
    with open(path, "rb") as f:
        lines = list(_lines(f, file_hash))
    offsets = array("q", (offset for offset, _ in lines))
    return RowIndex(path, file_hash.hexdigest(), offsets, b"".join(_digest(line) for _, line in lines), None)


def label_rows(rows: RowIndex, template: ChatTemplate, max_seq_len: int, indices) -> list[Example]:
    """The rows at ``indices`` (0-based, any order) labelled, read back from the file ``rows`` was scanned from."""
    examples = []
    with open(rows.path, "rb") as f:
        for index in indices:
            f.seek(rows.offsets[index])
            raw = f.readline()
            line = raw[:-1] if raw.endswith(b"\n") else raw
            # a row that changed since the scan would silently get another row's prior
            if _digest(line) != rows.digests[32 * index : 32 * index + 32]:
                problem = "the row changed while rpb was reading the file; rerun on a file that stays as it is"
                raise DataError(str(rows.path), [RowError(index + 1, "changed-during-collection", problem)])
            ids, spans = label_row(template, parse_row(line), max_seq_len)
            examples.append(Example(index, ids, spans))
    return examples


def label_range(rows: RowIndex, template: ChatTemplate, max_seq_len: int, start: int, stop: int) -> list[Example]:
    """Rows ``[start, stop)`` labelled (see ``label_rows``), or as the scan kept them."""
    if rows.examples is not None:
        return list(rows.examples[start:stop])
    return label_rows(rows, template, max_seq_len, range(start, stop))
