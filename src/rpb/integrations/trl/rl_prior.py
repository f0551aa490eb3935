"""RPB in GRPO: which prior row and span each token of a rollout reads (docs/rl.md, "RPB in RL").

The rule, and why:

* **Data.** The prompts file is a data file of rpb's own format whose rows hold a prompt and a reference answer
  (RL data sets carry one for the reward): ``rpb collect`` runs over it as over SFT data, so every row has its
  Q prior (the base's routing over the prompt) and its A prior (the base's routing over the reference answer).
  GRPO's prompt is the row's conversation up to its last assistant message (a reference row: its ``input``).
* **Prompt tokens** take the labels rpb's labelling gives them (Q for the user's content, structural for the
  template's text, A for an earlier assistant turn): TRL's own tokens of the prompt must equal rpb's, token by
  token, or the rollout is refused naming its row and the first position that differs.
* **Completion tokens** take the row's A prior: the base's routing over a correct answer to the same prompt is
  the measured stand-in for the routing an answer to it should keep (the prior is per sample and span, and a
  generated completion has no prior of its own before it exists). A completion's end-of-turn token is
  labelled A as well (the model produced it).
* **Where the bias applies**: the training forward and the old-log-prob forward that stands for it (so the
  importance ratio compares like with like); never generation (rollouts stay bias-free, like the model that
  will be served) and never the reference model.

Shape legend: B = rollouts, P / C = the padded prompt / completion lengths.
"""

from __future__ import annotations

from pathlib import Path

import datasets
import torch

from rpb.anchors import AnchorConfig, AnchorHandle
from rpb.data.jsonl import MessagesRow, parse_object, read_jsonl, split_lines
from rpb.data.tokens import first_difference
from rpb.errors import ConfigError
from rpb.integrations.trl.sft import prepare
from rpb.prior import STRUCTURAL

A_SPAN = 1
#: the dataset columns rpb adds beside TRL's ``prompt`` (an RPB run's GRPOTrainer asks for them)
PREPARED_COLUMNS = ("rpb_sample_index", "rpb_input_ids", "rpb_span_ids")
#: the column holding each row's reference answer (its last assistant message, or its ``output``): TRL hands
#: every column but ``prompt`` to the reward functions as a keyword argument
REFERENCE_COLUMN = "reference_answer"
#: a row's own fields that cannot become columns: rpb's and TRL's own, and the row's text itself
_TAKEN = {"prompt", REFERENCE_COLUMN, *PREPARED_COLUMNS}
_ROW_TEXT = {"messages", "input", "output"}


def prepare_grpo(
    model, tokenizer, data_jsonl: str, anchor: AnchorConfig, prior: str | None = None, **options
) -> tuple[AnchorHandle, datasets.Dataset]:
    """Label the prompts file, check the prior against it and the model (``rpb train``'s errors), install the
    anchor; returns ``(handle, dataset)`` for ``GRPOTrainer(..., train_dataset=dataset, anchor=handle)``: TRL's
    ``prompt`` column; the row's reference answer (``reference_answer``) and every other field of the row under
    its own name, which TRL hands to the reward functions; and, per row, its sample index and rpb's tokens and
    span labels. ``options``: ``prepare``'s
    keyword arguments (``max_seq_len``, ``model_id``, ``chat_template_kwargs``)."""
    handle, labelled = prepare(model, tokenizer, data_jsonl, anchor, prior, **options)
    rows, _ = read_jsonl(data_jsonl)  # prepare has refused every bad row already
    raw = [parse_object(line) for line in split_lines(Path(data_jsonl).read_bytes())]
    problems, records = [], []
    for example, row, obj in zip(labelled.examples, rows, raw, strict=True):
        extra = {k: v for k, v in obj.items() if k not in _ROW_TEXT}
        if taken := sorted(_TAKEN & set(extra)):
            problems.append(
                f"{data_jsonl}:{example.index + 1}: [{taken[0]}] a row's own field named as a column rpb or TRL "
                f"adds ({', '.join(taken)}): rename it"
            )
            continue
        if isinstance(row, MessagesRow):
            last = max((i for i, m in enumerate(row.messages) if m["role"] == "assistant"), default=None)
            if last is None or last != len(row.messages) - 1:
                problems.append(
                    f"{data_jsonl}:{example.index + 1}: [messages] the last message must be the "
                    "assistant's reference answer (the completion's prior is its A span)"
                )
                continue
            prompt, reference = [dict(m) for m in row.messages[:last]], row.messages[last]["content"]
        else:
            prompt, reference = row.input, row.output
        records.append(
            {
                **extra,
                "prompt": prompt,
                REFERENCE_COLUMN: reference,
                "rpb_sample_index": example.index,
                "rpb_input_ids": example.input_ids,
                "rpb_span_ids": example.span_ids,
            }
        )
    if problems:
        handle.remove()
        raise ConfigError("rpb.integrations.trl.prepare_grpo", problems)
    return handle, datasets.Dataset.from_list(records)


def rollout_labels(
    rows: list[dict],
    prompt_ids: list[list[int]],
    completion_ids: list[list[int]],
    tool_mask: list[list[int]] | None = None,
):
    """Per rollout ``(sample index, its prompt tokens' span ids, its completion tokens' span ids)``: A on what the
    model generated, structural on a tool's result inside the completion (``tool_mask`` 0: text the model did not
    write, like the template's); a prompt whose tokens are not rpb's prefix of its row is refused, every such
    rollout listed."""
    out, problems = [], []
    for b, (row, p, c) in enumerate(zip(rows, prompt_ids, completion_ids, strict=True)):
        ids, spans = row["rpb_input_ids"], row["rpb_span_ids"]
        differs = first_difference(p, list(ids))
        if differs is not None and differs == len(p) < len(ids):
            differs = None  # the prompt is a prefix of its row: the row goes on with the reference answer
        if differs is not None:
            problems.append(
                f"rollout {b} (row {row['rpb_sample_index']}): TRL's prompt token {differs} is "
                f"{p[differs] if differs < len(p) else None}, rpb's labelling has "
                f"{ids[differs] if differs < len(ids) else None}: the prompt was rendered otherwise (template, "
                "its keyword arguments, or the tokenizer), so its tokens' (sample, span) would be wrong"
            )
            continue
        generated = tool_mask[b] if tool_mask is not None else [1] * len(c)
        completion = [A_SPAN if keep else STRUCTURAL for keep in generated]
        out.append((int(row["rpb_sample_index"]), list(spans[: len(p)]), completion))
    if problems:
        raise ConfigError("rpb.integrations.trl.GRPOTrainer", problems)
    return out


def batch_labels(labels, P: int, C: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``(sample_B, span_BS)`` in TRL's padded layout (prompt left-padded to P, completion right-padded to C):
    the prompt's own labels, the completion's (A, structural on a tool's result), structural on padding."""
    B = len(labels)
    span_BS = torch.full((B, P + C), STRUCTURAL, dtype=torch.long)
    sample_B = torch.empty(B, dtype=torch.long)
    for b, (sample, prompt_spans, completion_spans) in enumerate(labels):
        sample_B[b] = sample
        span_BS[b, P - len(prompt_spans) : P] = torch.tensor(prompt_spans, dtype=torch.long)
        span_BS[b, P : P + len(completion_spans)] = torch.tensor(completion_spans, dtype=torch.long)
    return sample_B, span_BS
