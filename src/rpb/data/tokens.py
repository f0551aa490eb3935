"""Tokenize a rendered conversation once and label every token Q, A or structural.

A token whose characters overlap a content range takes that content's label (the
larger overlap wins where a token straddles two ranges). Fast tokenizers give
character offsets directly. Slow tokenizers (Moonlight's tiktoken-based one, for
example) give none, so the offsets are recovered without re-tokenizing differently:
first by checking that tokenizing the pieces between range boundaries reproduces the
single tokenization exactly, else by binary search on decoded prefix lengths.
"""

from __future__ import annotations

import bisect
import itertools

import torch

from rpb.data.errors import RowProblem
from rpb.data.template import CharRange
from rpb.prior import STRUCTURAL


def _encode(tokenizer, text: str) -> list[int]:
    return list(tokenizer(text, add_special_tokens=False)["input_ids"])


def _decode(tokenizer, ids: list[int]) -> str:
    kwargs = {"skip_special_tokens": False, "clean_up_tokenization_spaces": False}
    try:
        return tokenizer.decode(ids, spaces_between_special_tokens=False, **kwargs)
    except TypeError:  # fast tokenizers take no spaces_between_special_tokens
        return tokenizer.decode(ids, **kwargs)


def label_offsets(offsets: list[tuple[int, int]], ranges: list[CharRange]) -> list[int]:
    """Span id of each token given its character offsets (pure; see module doc)."""
    if not offsets:
        return []
    off_T2 = torch.tensor(offsets, dtype=torch.long).view(-1, 2)
    labels_T = torch.full((off_T2.shape[0],), STRUCTURAL, dtype=torch.long)
    best_T = torch.zeros(off_T2.shape[0], dtype=torch.long)
    for a, b, span in ranges:
        overlap_T = torch.minimum(off_T2[:, 1], torch.tensor(b)) - torch.maximum(off_T2[:, 0], torch.tensor(a))
        wins_T = overlap_T > best_T
        labels_T[wins_T] = span
        best_T = torch.where(wins_T, overlap_T, best_T)
    return labels_T.tolist()


def _offsets_from_pieces(tokenizer, text: str, ids: list[int], ranges: list[CharRange]):
    """Offsets when tokenizing the pieces between boundaries reproduces ``ids`` exactly."""
    cuts = sorted({0, len(text), *(p for a, b, _ in ranges for p in (a, b))})
    offsets, piece_ids = [], []
    for lo, hi in itertools.pairwise(cuts):
        sub = _encode(tokenizer, text[lo:hi])
        piece_ids.extend(sub)
        offsets.extend([(lo, hi)] * len(sub))  # each token lies inside its piece
    return offsets if piece_ids == ids else None


def _offsets_from_decoding(tokenizer, text: str, ids: list[int], ranges: list[CharRange]):
    """Offsets of the tokens around each boundary, by binary search on decoded prefix lengths."""
    if _decode(tokenizer, ids) != text:
        raise RowProblem(
            "tokenizer-no-offsets",
            "the tokenizer gives no offset mapping, tokenizing the pieces between content boundaries "
            "changes the tokens, and decoding does not reproduce the text, so spans cannot be located",
        )
    cache: dict[int, int] = {}

    def prefix_len(k: int) -> int:
        if k not in cache:
            cache[k] = len(_decode(tokenizer, ids[:k]))
        return cache[k]

    class Prefix:  # lazily evaluated, monotone sequence for bisect
        def __len__(self):
            return len(ids) + 1

        def __getitem__(self, k):
            return prefix_len(k)

    prefix = Prefix()
    labels_from: list[tuple[int, int, int]] = []
    for a, b, span in ranges:
        first = bisect.bisect_right(prefix, a) - 1  # last token starting at or before a
        last = bisect.bisect_left(prefix, b)  # first prefix reaching b
        labels_from.append((max(first, 0), min(last, len(ids)), span))
    return labels_from


def tokenize_labelled(
    tokenizer, text: str, ranges: list[CharRange], max_len: int | None = None
) -> tuple[list[int], list[int]]:
    """``(ids, span_ids)`` of the tokenization of ``text``, right-truncated to ``max_len`` (None: whole)."""
    if getattr(tokenizer, "is_fast", False):
        enc = tokenizer(text, add_special_tokens=False, return_offsets_mapping=True)
        ids, offsets = list(enc["input_ids"]), [tuple(o) for o in enc["offset_mapping"]]
        labels = label_offsets(offsets, ranges)
    else:
        ids = _encode(tokenizer, text)
        offsets = _offsets_from_pieces(tokenizer, text, ids, ranges)
        if offsets is not None:
            labels = label_offsets(offsets, ranges)
        else:
            labels = [STRUCTURAL] * len(ids)
            for lo, hi, span in _offsets_from_decoding(tokenizer, text, ids, ranges):
                for t in range(lo, hi):
                    labels[t] = span
    return ids[:max_len], labels[:max_len]


def as_tensors(ids: list[int], labels: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
    return torch.tensor(ids, dtype=torch.long), torch.tensor(labels, dtype=torch.long)


def first_difference(ids: list[int], labelled: list[int]) -> int | None:
    """The first position where ``ids`` (what another tool tokenized: TRL's prompt, an engine's request) and rpb's
    labelling of the row differ, a length difference included (the shorter one's end); None where they are equal."""
    at = next((i for i, (a, b) in enumerate(zip(ids, labelled, strict=False)) if a != b), None)
    if at is None and len(ids) != len(labelled):
        at = min(len(ids), len(labelled))
    return at
