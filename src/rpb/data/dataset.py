"""A data file turned into labelled examples, and the padding collator.

``load_labelled`` reads, renders and tokenizes every row, and raises one
``DataError`` listing every bad row before anything is computed.
"""

from __future__ import annotations

import dataclasses
import hashlib
import logging
import struct
from collections import OrderedDict
from dataclasses import dataclass, field
from pathlib import Path

import torch

from rpb.data.errors import DataError, RowError, RowProblem
from rpb.data.jsonl import A_ROLES, Q_ROLES, ReferenceRow, file_sha256, read_jsonl
from rpb.data.reasoning import merge_channels, split_turn
from rpb.data.template import ChatTemplate
from rpb.data.tokens import tokenize_labelled
from rpb.errors import ArgumentError
from rpb.prior import SPAN_A, SPAN_Q, STRUCTURAL

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class Example:
    """One row: its sample index (0-based line), token ids and per-token span ids."""

    index: int
    input_ids: list[int]
    span_ids: list[int]

    def __len__(self) -> int:
        return len(self.input_ids)

    @property
    def token_sha256(self) -> str:
        """sha256 of the row's tokens and span ids (each list as its int64 count, then its int64 values,
        little-endian): what two environments that label the same row (rpb under one transformers,
        Megatron-Bridge's dataset under another) must agree on, since the prior's keys are token spans."""
        h = hashlib.sha256()
        for values in (self.input_ids, self.span_ids):
            h.update(struct.pack(f"<q{len(values)}q", len(values), *values))
        return h.hexdigest()


@dataclass(frozen=True)
class LabelledData:
    path: str
    sha256: str
    examples: list[Example]
    #: what besides the template decided the rendering (``ChatTemplate.settings``)
    template_settings: dict = field(default_factory=dict)
    #: assistant turns carrying a reasoning, and those the template did not render (``ReasoningCount``)
    reasoning: dict = field(default_factory=dict)
    #: rows whose rendered tokens exceed max_seq_len, cut on the right (``label_row``)
    truncated_rows: int = 0

    @property
    def num_rows(self) -> int:
        return len(self.examples)

    @property
    def num_tokens(self) -> int:
        return sum(len(e) for e in self.examples)


def label_row(template: ChatTemplate, row, max_seq_len: int) -> tuple[list[int], list[int]]:
    """``(ids, span_ids)`` of ``row``, right-truncated to ``max_seq_len``; a row cut by it adds one to
    ``template.truncated_rows``. A row whose Q or A span has no token left raises RowProblem saying why."""
    text, ranges = template.locate(row)
    ids, spans = tokenize_labelled(template.tokenizer, text, ranges)
    for span in (SPAN_Q, SPAN_A):
        if span not in spans[:max_seq_len]:
            raise _no_tokens(row, ranges, span, max_seq_len)
    template.truncated_rows += len(ids) > max_seq_len
    return ids[:max_seq_len], spans[:max_seq_len]


def _no_tokens(row, ranges, span: int, max_seq_len: int) -> RowProblem:
    """Why a row's Q or A span has no token: empty messages, or text that truncation cut off."""
    name, kind, roles = {
        SPAN_Q: ("Q (user content)", "empty-q-span", Q_ROLES),
        SPAN_A: ("A (assistant)", "empty-a-span", A_ROLES),
    }[span]
    if any(s == span and b > a for a, b, s in ranges):
        return RowProblem(kind, f"the {name} span has no tokens after truncation to max_seq_len={max_seq_len}")
    if isinstance(row, ReferenceRow):
        key, what = ("input", "user turn") if span == SPAN_Q else ("output", "assistant body")
        return RowProblem(kind, f"{key!r} holds an empty {what}: the {name} span has no text to label", key)
    empty = _empty_messages(row.messages, roles)
    if not empty:  # a rendering that left no text of non-empty messages (not seen in practice)
        return RowProblem(kind, f"the {name} span has no tokens within max_seq_len={max_seq_len}")
    role = row.messages[empty[0][0]]["role"]
    said = "; ".join(f"message {i} ({role}) {why}" for i, why in empty)
    return RowProblem(kind, f"{said}: the {name} span has no text to label", f"messages[{empty[0][0]}].content")


def _empty_messages(messages, roles) -> list[tuple[int, str]]:
    """(index, why) of each message of ``roles`` that renders no content: empty or whitespace only, or an
    assistant answer that is, beside a reasoning the template leaves out (a span with text comes here only so)."""
    merged, origin = merge_channels(list(messages))
    out = []
    for m, i in zip(merged, origin, strict=True):
        if m["role"] not in roles:
            continue
        turn = split_turn(m, i) if m["role"] in A_ROLES else None
        answer = turn.answer if turn is not None else m["content"]
        if answer.strip():
            continue
        why = "is empty" if answer == "" else "holds only whitespace"
        if turn is not None and turn.reasoning is not None and turn.reasoning.strip():
            why = f"has an empty answer, and the chat template does not render its reasoning ({turn.shape})"
        out.append((i, why))
    return out


def note_truncated(truncated: int, rows: int, max_seq_len: int) -> None:
    """Say (log warning) how many rows ``max_seq_len`` cut: their tokens past it are neither routed nor trained."""
    if truncated:
        logger.warning(
            "rpb: %d of %d row(s) are longer than max_seq_len=%d tokens and were cut on the right (their tokens "
            "past it are neither routed nor trained); recorded as truncated_rows",
            truncated,
            rows,
            max_seq_len,
        )


#: the last files labelled in this process, by everything their labels depend on (the file's bytes, the
#: tokenizer's vocabulary, rules and template, max_seq_len, the template's arguments and day): a study trains
#: many cells on one file, and labelling 20,000 conversations took 4-5 s of every toy-world cell
_LABELLED: OrderedDict[tuple, LabelledData] = OrderedDict()
_LABELLED_KEEP = 2


def forget_labelled() -> None:
    """Drop the files labelled so far (the next ``load_labelled`` of each labels it again)."""
    _LABELLED.clear()


def tokenizer_digest(tokenizer) -> str:
    """What a tokenizer's output depends on, hashed: its vocabulary and rules (the whole fast tokenizer's
    JSON, or a slow one's vocabulary), special tokens, chat template and padding / truncation sides."""
    h = hashlib.sha256(type(tokenizer).__name__.encode())
    backend = getattr(tokenizer, "backend_tokenizer", None)
    h.update(backend.to_str().encode() if backend is not None else repr(sorted(tokenizer.get_vocab().items())).encode())
    for part in (
        tokenizer.chat_template,
        tokenizer.special_tokens_map,
        tokenizer.padding_side,
        tokenizer.truncation_side,
        getattr(tokenizer, "added_tokens_encoder", None),
    ):
        h.update(repr(part).encode())
    return h.hexdigest()


def load_labelled(
    path: str | Path, tokenizer, max_seq_len: int, template_kwargs: dict | None = None, date: str | None = None
) -> LabelledData:
    """Every row of ``path`` labelled; raises DataError listing all bad rows. ``template_kwargs`` and
    ``date``: the chat template's keyword arguments and the day it sees (``ChatTemplate``). A file labelled
    before in this process with the same tokenizer and settings is not labelled again."""
    if max_seq_len < 2:
        raise ArgumentError(f"max_seq_len must be >= 2, got {max_seq_len}")
    path = Path(path)
    template = ChatTemplate(tokenizer, template_kwargs, date)
    key = (file_sha256(path), tokenizer_digest(tokenizer), max_seq_len, repr(sorted(template.settings.items())))
    if key in _LABELLED:
        _LABELLED.move_to_end(key)
        return dataclasses.replace(_LABELLED[key], path=str(path))
    data = _label_file(path, template, max_seq_len)
    _LABELLED[key] = data
    while len(_LABELLED) > _LABELLED_KEEP:
        _LABELLED.popitem(last=False)
    return data


def _label_file(path: Path, template: ChatTemplate, max_seq_len: int) -> LabelledData:
    rows, errors = read_jsonl(path)
    examples: list[Example] = []
    for index, row in enumerate(rows):
        if row is None:
            continue
        try:
            ids, spans = label_row(template, row, max_seq_len)
        except RowProblem as p:
            errors.append(p.at(index + 1))
            continue
        examples.append(Example(index, ids, spans))
    if not rows:
        errors.append(RowError(1, "empty-file", "the data file has no rows"))
    if errors:
        raise DataError(str(path), sorted(errors, key=lambda e: e.line))
    return LabelledData(
        str(path), file_sha256(path), examples, template.settings, template.reasoning.as_dict(), template.truncated_rows
    )


def collate(examples: list[Example], pad_id: int = 0) -> dict[str, torch.Tensor]:
    """Right-pad a batch. Padding gets attention 0 and span STRUCTURAL, so it never counts."""
    width = max(len(e) for e in examples)
    ids_BT = torch.full((len(examples), width), pad_id, dtype=torch.long)
    mask_BT = torch.zeros((len(examples), width), dtype=torch.long)
    span_BT = torch.full((len(examples), width), STRUCTURAL, dtype=torch.long)
    for b, e in enumerate(examples):
        n = len(e)
        ids_BT[b, :n] = torch.tensor(e.input_ids)
        mask_BT[b, :n] = 1
        span_BT[b, :n] = torch.tensor(e.span_ids)
    index_B = torch.tensor([e.index for e in examples], dtype=torch.long)
    return {"input_ids": ids_BT, "attention_mask": mask_BT, "span_ids": span_BT, "sample_index": index_B}
