"""``rpb retention --revert-routers``: does the routing drift matter? The post-trained model run with the base's
routers put back, beside the post model and the base, on the same tokens of each domain.

Per domain (a JSONL file of question/answer rows) and model variant it measures:

- the mean answer-span negative log-likelihood: per row, the mean over the tokens the training loss reads
  (``rpb.data.batches.answer_mask``: the assistant's content and the token that ends its turn), then the mean over
  rows. The prompt's tokens never count: the revert is judged on what the model answers;
- the top-k overlap of its routing to the base's, per span (all tokens, question, answer): that the routing really
  went back;
- with ``generate``, exact match: greedy decoding from each row's prompt (everything before its first answer
  token), the decoded text up to the turn's end token against the reference answer's, both stripped.

The variants are made by swapping router tensors in place (``rpb.adapters.revert.routers_of``) around each batch,
so two models are held at once, however many variants run, and each model is its own again after every batch:

- ``post``: the post-trained model;
- ``post+base routers``: the post model with every MoE router's weight, router bias and expert-correction bias
  the base's (``put_routers``; the shared-expert gates too when asked);
- ``base``: the base model;
- ``base+post routers`` (``reverse``): the base with the post model's routers.

A revert is an intervention on a model whose experts and attention co-adapted with its routing, not the model
that post-training would have made with the base's routing held: docs/retention.md says what it can show.
"""

from __future__ import annotations

import contextlib
import copy
from dataclasses import dataclass, field

import torch
from torch.nn.functional import cross_entropy

from rpb.adapters.revert import routers_of
from rpb.data import Example, collate
from rpb.data.batches import IGNORE_INDEX, labels_for
from rpb.observe.trace import RouterTap
from rpb.prior import SPAN_A
from rpb.retention.stats import SUBSETS, PairedOverlap

POST, REVERTED, BASE, REVERSED = "post", "post+base routers", "base", "base+post routers"


def variants(reverse: bool) -> tuple[str, ...]:
    """The variants a revert measures, in report order."""
    return (POST, REVERTED, BASE, *((REVERSED,) if reverse else ()))


@dataclass
class Pair:
    """The two models a revert holds (causal LMs of one family), their MoE layers and the family's facts."""

    base: torch.nn.Module
    post: torch.nn.Module
    base_layers: list
    post_layers: list
    facts: object
    shared_gates: bool = False

    @contextlib.contextmanager
    def running(self, variant: str):
        """(model, its MoE layers) running as ``variant`` inside the block; each model is its own again after."""
        if variant == REVERTED:
            with routers_of(self.post, self.base, self.facts, ("post", "base"), self.shared_gates):
                yield self.post, self.post_layers
        elif variant == REVERSED:
            with routers_of(self.base, self.post, self.facts, ("base", "post"), self.shared_gates):
                yield self.base, self.base_layers
        else:
            yield (self.post, self.post_layers) if variant == POST else (self.base, self.base_layers)


@dataclass
class VariantFigures:
    """One variant on one domain: per-row answer NLL, the overlap to the base, exact match."""

    nll_rows: list[float] = field(default_factory=list)
    answer_tokens: int = 0
    overlap: PairedOverlap | None = None
    correct: list[bool] | None = None

    def summary(self) -> dict:
        mean_SL = self.overlap.mean_SL()
        out = {
            "nll": sum(self.nll_rows) / len(self.nll_rows),
            "topk_overlap": {s: float(mean_SL[i].mean()) for i, s in enumerate(SUBSETS)},
            "topk_overlap_by_layer": [float(v) for v in mean_SL[0]],
            "nll_rows": self.nll_rows,
        }
        if self.correct is not None:
            out["exact_match"] = sum(self.correct) / len(self.correct)
        return out


def answer_nll_B(logits_BTV: torch.Tensor, labels_BT: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Each row's mean next-token NLL over its labelled tokens, and how many there are (``labels_BT``: the token
    ids where the loss reads, ``IGNORE_INDEX`` elsewhere)."""
    target_BT = labels_BT[:, 1:]
    nll_BT = cross_entropy(
        logits_BTV[:, :-1].float().transpose(1, 2), target_BT, ignore_index=IGNORE_INDEX, reduction="none"
    )
    count_B = (target_BT != IGNORE_INDEX).sum(1)
    return nll_BT.sum(1) / count_B.clamp_min(1), count_B


@torch.inference_mode()
def measure_domain(
    pair: Pair, examples: list[Example], names: tuple[str, ...], batch_size: int, pad_id: int, progress=None
) -> dict[str, VariantFigures]:
    """Every variant in ``names`` on ``examples``: answer NLL per row and the overlap of its routing to the
    base's on the same batches."""
    num_layers, num_experts = len(pair.base_layers), int(pair.base_layers[0].router.weight.shape[0])
    figures = {v: VariantFigures(overlap=PairedOverlap(num_layers, num_experts)) for v in names}
    taps = {id(pair.base): RouterTap(pair.base_layers), id(pair.post): RouterTap(pair.post_layers)}
    for tap in taps.values():
        tap.__enter__()
    try:
        for start in range(0, len(examples), batch_size):
            chunk = examples[start : start + batch_size]
            b = collate(chunk, pad_id)
            width = b["input_ids"].shape[1]
            labels_BT = torch.tensor([labels_for(e, "answer") + [IGNORE_INDEX] * (width - len(e)) for e in chunk])
            valid_T, span_T = b["attention_mask"].reshape(-1).bool(), b["span_ids"].reshape(-1)
            base_ids = None
            for v in (BASE, *(n for n in names if n != BASE)):  # the base first: the others are compared to it
                with pair.running(v) as (model, _):
                    device = next(model.parameters()).device
                    logits = model(
                        input_ids=b["input_ids"].to(device),
                        attention_mask=b["attention_mask"].to(device),
                        use_cache=False,
                    ).logits
                    nll_B, count_B = answer_nll_B(logits.cpu(), labels_BT)
                    ids = [t.cpu() for t in taps[id(model)].topk_ids]
                if base_ids is None:
                    base_ids = ids
                if v not in figures:
                    continue
                figures[v].nll_rows += [float(x) for x in nll_B]
                figures[v].answer_tokens += int(count_B.sum())
                for pos in range(num_layers):
                    figures[v].overlap.add(pos, ids[pos], base_ids[pos], valid_T, span_T)
            if progress is not None:
                progress.update(len(chunk))
    finally:
        for tap in taps.values():
            tap.__exit__(None, None, None)
    return figures


def prompt_and_answer(example: Example) -> tuple[list[int], list[int], int | None]:
    """A row's prompt (every token before its first answer token), its first answer run, and the token that ends
    that run (the turn's end; None when the row was cut inside its answer)."""
    spans = example.span_ids
    first = spans.index(SPAN_A)
    end = first
    while end < len(spans) and spans[end] == SPAN_A:
        end += 1
    stop = example.input_ids[end] if end < len(spans) else None
    return example.input_ids[:first], example.input_ids[first:end], stop


@torch.inference_mode()
def greedy_correct(
    model, tokenizer, examples: list[Example], max_new_tokens: int, batch_size: int, pad_id: int
) -> list[bool]:
    """Exact match per row: greedy decoding from the prompt, left-padded, stopped at any row's turn-end token;
    the text decoded up to that token against the reference answer's, both stripped."""
    parts = [prompt_and_answer(e) for e in examples]
    stops = sorted({s for _, _, s in parts if s is not None})
    device = next(model.parameters()).device
    plain = copy.deepcopy(model.generation_config)
    # MiniMax-M2's config asks for multi-token-prediction drafting, whose weights transformers' class does not load
    # (generate then refuses): greedy decoding of the model itself gives the same tokens without it
    plain.use_mtp = False
    plain.max_new_tokens, plain.do_sample, plain.pad_token_id = max_new_tokens, False, pad_id
    plain.eos_token_id = stops or None
    correct = []
    for start in range(0, len(parts), batch_size):
        chunk = parts[start : start + batch_size]
        width = max(len(p) for p, _, _ in chunk)
        ids_BT = torch.tensor([[pad_id] * (width - len(p)) + p for p, _, _ in chunk])
        mask_BT = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p, _, _ in chunk])
        out = model.generate(input_ids=ids_BT.to(device), attention_mask=mask_BT.to(device), generation_config=plain)
        for row, (_, answer, _) in zip(out[:, width:].tolist(), chunk, strict=True):
            cut = next((i for i, t in enumerate(row) if t in stops), len(row))
            got = tokenizer.decode(row[:cut], skip_special_tokens=True)
            correct.append(got.strip() == tokenizer.decode(answer, skip_special_tokens=True).strip())
    return correct


def answer_budget(examples: list[Example]) -> int:
    """Greedy decoding's default budget: the longest reference answer, in tokens, and its turn-end token."""
    return max(len(prompt_and_answer(e)[1]) for e in examples) + 1


def generate_domain(pair: Pair, tokenizer, examples, names, figures, max_new_tokens, batch_size, pad_id) -> None:
    """Exact match of every variant in ``names`` on ``examples``, into ``figures``."""
    for v in names:
        with pair.running(v) as (model, _):
            figures[v].correct = greedy_correct(model, tokenizer, examples, max_new_tokens, batch_size, pad_id)
