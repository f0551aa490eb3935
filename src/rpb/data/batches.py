"""Training batches that carry, per token, the sample index (0-based JSONL row) and span id.

The data file is labelled by the same code as the collector (``rpb.data``), so a token's
(sample, span) here is exactly the key the prior was collected under. Shuffling, epochs,
batching and sharding move whole examples, and the per-token keys travel with them.

``loss_on="answer"`` trains on assistant content plus the token that ends each answer
(the turn end); ``"all"`` on every non-padding token.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal, get_args

import torch

from rpb.data.dataset import Example
from rpb.errors import ArgumentError
from rpb.prior import SPAN_A, STRUCTURAL

IGNORE_INDEX = -100
#: which tokens carry the language-model loss
LossOn = Literal["answer", "all"]
LOSS_ON: tuple[str, ...] = get_args(LossOn)


def answer_mask(span_ids: list[int]) -> list[bool]:
    """Assistant content tokens, plus the first token after each answer run (its turn end)."""
    mask = [s == SPAN_A for s in span_ids]
    for t in range(1, len(span_ids)):
        if span_ids[t - 1] == SPAN_A and span_ids[t] != SPAN_A:
            mask[t] = True
    return mask


def labels_for(example: Example, loss_on: str) -> list[int]:
    if loss_on not in LOSS_ON:
        raise ArgumentError(f"loss_on must be one of {LOSS_ON}, got {loss_on!r}")
    if loss_on == "all":
        return list(example.input_ids)
    return [t if m else IGNORE_INDEX for t, m in zip(example.input_ids, answer_mask(example.span_ids), strict=True)]


class ExampleDataset(torch.utils.data.Dataset):
    """Examples as dicts; the sampler's indices are positions here, ``index`` the JSONL row."""

    def __init__(self, examples: list[Example], loss_on: str = "answer"):
        self.examples = examples
        self.labels = [labels_for(e, loss_on) for e in examples]

    def __len__(self) -> int:
        return len(self.examples)

    def __getitem__(self, i: int) -> dict:
        e = self.examples[i]
        return {"input_ids": e.input_ids, "span_ids": e.span_ids, "labels": self.labels[i], "sample_index": e.index}


@dataclass
class AnchorCollator:
    """Right-pads a batch (or packs it) and adds ``rpb_sample_index`` / ``rpb_span`` per token.

    Padding gets attention 0, label -100, sample -1 and span STRUCTURAL. With ``pack=True``
    the examples are concatenated greedily into rows of at most ``max_len`` tokens with
    ``position_ids`` restarting at every example; each token keeps its own (sample, span),
    so the per-token bias is the one an unpacked batch would get. ``padding_free=True`` puts
    the whole batch into one row. Packed batches carry no attention mask: given one, transformers
    lets every token attend to the whole row, across examples; without one it derives each
    example's extent from the restarting ``position_ids`` (varlen kernels, or a block-diagonal
    mask for sdpa and eager), so attention stays inside each example. A packed row's padding has
    position 0 throughout, so each padding token is a block of its own (sample -1: the anchor
    counts it as padding). In both packed forms an example's first label is -100: after the
    shift it would be predicted from the previous example's last token.
    """

    pad_id: int = 0
    pack: bool = False
    max_len: int | None = None
    padding_free: bool = False

    def __call__(self, features: list[dict]) -> dict[str, torch.Tensor]:
        rows = [list(features)] if self.padding_free else self._pack(features) if self.pack else [[f] for f in features]
        packed = self.pack or self.padding_free
        width = max(sum(len(f["input_ids"]) for f in row) for row in rows)
        B = len(rows)
        out = {
            "input_ids": torch.full((B, width), self.pad_id, dtype=torch.long),
            "attention_mask": torch.zeros((B, width), dtype=torch.long),
            "labels": torch.full((B, width), IGNORE_INDEX, dtype=torch.long),
            "rpb_sample_index": torch.full((B, width), -1, dtype=torch.long),
            "rpb_span": torch.full((B, width), STRUCTURAL, dtype=torch.long),
        }
        if packed:
            out["position_ids"] = torch.zeros((B, width), dtype=torch.long)
        for b, row in enumerate(rows):
            t = 0
            for f in row:
                n = len(f["input_ids"])
                out["input_ids"][b, t : t + n] = torch.tensor(f["input_ids"])
                out["attention_mask"][b, t : t + n] = 1
                out["labels"][b, t : t + n] = torch.tensor(f["labels"])
                out["rpb_sample_index"][b, t : t + n] = f["sample_index"]
                out["rpb_span"][b, t : t + n] = torch.tensor(f["span_ids"])
                if packed:
                    out["position_ids"][b, t : t + n] = torch.arange(n)
                    out["labels"][b, t] = IGNORE_INDEX
                t += n
        if packed:
            del out["attention_mask"]
        return out

    def _pack(self, features: list[dict]) -> list[list[dict]]:
        limit = self.max_len or sum(len(f["input_ids"]) for f in features)
        rows: list[list[dict]] = []
        for f in features:
            n = len(f["input_ids"])
            used = sum(len(g["input_ids"]) for g in rows[-1]) if rows else None
            if rows and used + n <= limit:
                rows[-1].append(f)
            else:
                rows.append([f])
        return rows


def token_keys(batch: dict) -> list[tuple[int, int]]:
    """(sample, span) of every non-padding token, in order (for checking packed == unpacked)."""
    keys = zip(batch["rpb_sample_index"].reshape(-1).tolist(), batch["rpb_span"].reshape(-1).tolist(), strict=True)
    return [k for k in keys if k[0] >= 0]
