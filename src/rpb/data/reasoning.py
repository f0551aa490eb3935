"""Reasoning in assistant turns: the shapes a row carries it in, and probes that keep each shape.

Distilled-reasoning SFT data puts an assistant's reasoning before its answer in one of three shapes:

* ``<think>`` blocks inside the content: ``"<think>\\nR\\n</think>\\n\\nA"``;
* a ``reasoning_content`` field beside the content (``reasoning`` and ``thinking`` are the same field to
  transformers, which passes it to templates under every name);
* harmony's channels (gpt-oss): either a ``thinking`` field (the analysis channel; the content is the
  final channel), or an assistant message with ``"channel": "analysis"`` followed by one with
  ``"channel": "final"``, which are one turn.

``rpb.data.template`` renders a probe of the conversation in which every reasoning and answer is a
sentinel *in the row's own shape*, so the template treats the probe as it treats the row: it renders
the reasoning, drops it (earlier turns, or always), or rewrites it, and the sentinels that survive say
which. Nothing here knows a template; only the shapes rows come in.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from rpb.data.errors import RowProblem

#: message fields a reasoning is read from, as transformers aliases them for templates
REASONING_FIELDS = ("reasoning_content", "reasoning", "thinking")
_THINK = re.compile(r"^(\s*<think>\s*)(.*?)(\s*</think>\s*)(.*)$", re.S)


@dataclass(frozen=True)
class Turn:
    """One message's parts: its reasoning (None: it carries none) and its content, and the row's shape."""

    shape: str  # "plain", "think-tags" or the reasoning field's name
    reasoning: str | None
    answer: str
    #: think-tags: the text around the parts, kept so the probe is laid out as the row is
    head: str = ""
    middle: str = ""

    def probe(self, message: dict, reasoning_sentinel: str, answer_sentinel: str) -> dict:
        """The message with its reasoning and answer replaced by sentinels, in the same shape."""
        out = {k: v for k, v in message.items() if k not in ("content", *REASONING_FIELDS)}
        if self.shape == "plain":
            return out | {"content": answer_sentinel}
        if self.shape == "think-tags":
            return out | {"content": self.head + reasoning_sentinel + self.middle + answer_sentinel}
        return out | {"content": answer_sentinel, self.shape: reasoning_sentinel}


def split_turn(message: dict, index: int) -> Turn:
    """The reasoning and answer of an assistant message (a message without reasoning: plain)."""
    fields = [f for f in REASONING_FIELDS if message.get(f) is not None]
    for f in fields:
        if not isinstance(message[f], str):
            raise RowProblem(
                "non-string-field",
                f"{f!r} must be a string, got {type(message[f]).__name__}",
                f"messages[{index}].{f}",
            )
    if len({message[f] for f in fields}) > 1:
        raise RowProblem(
            "reasoning-conflict",
            f"the message carries different reasonings under {' and '.join(map(repr, fields))}; "
            "templates read them as one field, so keep one",
            f"messages[{index}]",
        )
    content = message["content"]
    match = _THINK.match(content)
    if fields and match:
        raise RowProblem(
            "reasoning-conflict",
            f"the message carries its reasoning both in {fields[0]!r} and as a <think> block in its content; keep one",
            f"messages[{index}]",
        )
    if fields:
        return Turn(fields[0], message[fields[0]], content)
    if match:
        head, reasoning, middle, answer = match.groups()
        return Turn("think-tags", reasoning, answer, head=head, middle=middle)
    return Turn("plain", None, content)


def merge_channels(messages: list[dict]) -> tuple[list[dict], list[int]]:
    """Harmony rows: an assistant ``analysis`` message followed by its ``final`` one become one turn with a
    ``thinking`` field (what gpt-oss's template reads). Returns the messages and, for each, the index of
    the row's message it came from (its final one, for a merged turn)."""
    out: list[dict] = []
    origin: list[int] = []
    i = 0
    while i < len(messages):
        m = messages[i]
        channel = m.get("channel")
        if channel is None:
            out.append(m)
            origin.append(i)
            i += 1
            continue
        nxt = messages[i + 1] if i + 1 < len(messages) else None
        if channel == "analysis" and nxt is not None and nxt.get("channel") == "final" and m["role"] == nxt["role"]:
            if any(nxt.get(f) is not None for f in REASONING_FIELDS):
                raise RowProblem(
                    "reasoning-conflict",
                    "a final-channel message after an analysis one carries a reasoning too",
                    f"messages[{i + 1}]",
                )
            merged = {k: v for k, v in nxt.items() if k != "channel"} | {"thinking": m["content"]}
            out.append(merged)
            origin.append(i + 1)
            i += 2
            continue
        if channel == "final":
            out.append({k: v for k, v in m.items() if k != "channel"})
            origin.append(i)
            i += 1
            continue
        raise RowProblem(
            "unknown-channel",
            f"channel {channel!r}: an 'analysis' message is read with the 'final' message that follows it "
            "(or give the reasoning as 'thinking' beside the final content)",
            f"messages[{i}].channel",
        )
    return out, origin


def note_reasoning(counts: dict, settings: dict, out=None) -> None:
    """Say once (stderr) when the template left out reasonings the rows carry: the default is to train on what
    it renders; its own switch (``chat_template_kwargs``) is the other choice."""
    import sys

    if not counts.get("dropped_turns"):
        return
    kwargs = settings.get("chat_template_kwargs") or {}
    print(
        f"rpb: the chat template (with {kwargs or 'no keyword arguments'}) does not render the reasoning of "
        f"{counts['dropped_turns']} of {counts['turns']} assistant turn(s) that carry one, in "
        f"{counts['rows_dropped']} row(s); those turns are labelled as it renders them, without it (recorded in "
        "the prior's metadata as 'reasoning'). Where the template has a switch that renders it (enable_thinking, "
        "thinking), set it with --chat-template-kwargs / data.chat_template_kwargs.",
        file=out or sys.stderr,
    )
