"""Where the Q and A content sits in a rendered conversation, learnt from the chat template.

Nothing here knows any model's markers. The template is rendered on *probe*
conversations whose contents are unique sentinels; the text around the sentinels is
the template's own structure (role markers, role names, default system prompts,
inserted think blocks, turn ends). A real conversation is then laid onto that
skeleton, which gives the exact character range of every message's content.

Ranges are ``(start, end, span)`` with span SPAN_Q for user content and SPAN_A for
assistant content; system and tool messages stay structural.
"""

from __future__ import annotations

import datetime
import hashlib
from contextlib import contextmanager, nullcontext
from dataclasses import dataclass
from functools import cached_property

from rpb.data.errors import RowProblem
from rpb.data.jsonl import A_ROLES, Q_ROLES, MessagesRow, ReferenceRow, Row
from rpb.data.reasoning import merge_channels, split_turn
from rpb.errors import RpbError
from rpb.prior import SPAN_A, SPAN_Q

CharRange = tuple[int, int, int]


def _sentinel(i: int) -> str:
    # Letters and digits only, so no template filter (trim, escape, split) alters it.
    return f"RPBPROBE{i}X"


def _span_of(role: str) -> int | None:
    if role in Q_ROLES:
        return SPAN_Q
    if role in A_ROLES:
        return SPAN_A
    return None


def _split_on_sentinels(text: str, sentinels: list[str]) -> list[str]:
    """Split a probe rendering into the structural segments around its sentinels (n -> n + 1)."""
    segments, cursor = [], 0
    for i, sentinel in enumerate(sentinels):
        pos = text.find(sentinel, cursor)
        if pos < 0:
            raise RowProblem(
                "template-drops-content",
                f"the chat template does not render the content of message {i} (role-dependent filtering?)",
            )
        segments.append(text[cursor:pos])
        cursor = pos + len(sentinel)
    segments.append(text[cursor:])
    return segments


class TemplateError(RpbError):
    """A tokenizer whose chat template cannot locate Q/A content."""


#: apply_chat_template's own parameters, which template keyword arguments may not set
# fmt: skip below: a table of data, kept aligned row by row (the formatter would put one item per line)
_RESERVED = frozenset({
    "conversation", "tools", "documents", "chat_template", "add_generation_prompt", "continue_final_message",
    "tokenize", "padding", "truncation", "max_length", "return_tensors", "return_dict",
    "return_assistant_tokens_mask", "tokenizer_kwargs",
})  # fmt: skip


@dataclass
class ReasoningCount:
    """Assistant turns that carried a reasoning, and those whose reasoning the template did not render."""

    turns: int = 0
    dropped: int = 0
    rows_dropped: int = 0

    def count(self, turns, dropped: list[int]) -> None:
        self.turns += sum(t is not None and t.reasoning is not None for t in turns)
        self.dropped += len(dropped)
        self.rows_dropped += bool(dropped)

    def as_dict(self) -> dict:
        return {"turns": self.turns, "dropped_turns": self.dropped, "rows_dropped": self.rows_dropped}


@contextmanager
def _clock_at(day: str):
    """transformers' ``strftime_now`` reads ``datetime.now()`` of its chat-template module: pin it to ``day``."""
    from transformers.utils import chat_template_utils as ctu

    real = getattr(ctu, "datetime", None)
    if real is None or not hasattr(real, "now"):
        raise TemplateError(
            "the chat template reads the clock (strftime_now) and this transformers version renders it "
            "otherwise than rpb can pin; collection and training could render different dates"
        )
    pinned = real.combine(real.strptime(day, "%Y-%m-%d").date(), real.min.time())

    class Pinned(real):
        @classmethod
        def now(cls, tz=None):
            return pinned

    ctu.datetime = Pinned
    try:
        yield
    finally:
        ctu.datetime = real


class ChatTemplate:
    """The tokenizer's chat template, probed once, used to locate content in rows.

    ``kwargs``: the template's own keyword arguments (``enable_thinking``, ``thinking``,
    ``reasoning_effort``), passed to every rendering. ``date``: the day a template that reads the clock
    (gpt-oss's ``strftime_now``) sees, so collection and training render the same tokens on different
    days; default today, recorded by the caller (``settings``)."""

    def __init__(self, tokenizer, kwargs: dict | None = None, date: str | None = None):
        if not getattr(tokenizer, "chat_template", None):
            raise TemplateError(
                f"tokenizer {getattr(tokenizer, 'name_or_path', '?')!r} has no chat template; "
                "Q/A spans are derived from it, so one is required"
            )
        self.tokenizer = tokenizer
        self.kwargs = dict(kwargs or {})
        reserved = sorted(_RESERVED & set(self.kwargs))
        if reserved:
            raise TemplateError(f"chat template keyword arguments may not set {', '.join(reserved)}")
        self.reads_clock = "strftime_now" in self._source
        self.date = (date or datetime.date.today().isoformat()) if self.reads_clock else None
        self.reasoning = ReasoningCount()
        #: rows ``rpb.data.dataset.label_row`` cut to max_seq_len, counted (like ``reasoning``) by every
        #: labelling through this template: a caller reads it after one pass over its rows
        self.truncated_rows = 0

    @property
    def _source(self) -> str:
        template = self.tokenizer.chat_template
        if isinstance(template, dict):  # named templates
            template = "\n".join(f"{k}\n{v}" for k, v in sorted(template.items()))
        return template

    @property
    def sha256(self) -> str:
        return hashlib.sha256(self._source.encode("utf-8")).hexdigest()

    @property
    def settings(self) -> dict:
        """What besides the template decides the rendering: recorded with a prior, compared by train / validate."""
        return {"chat_template_kwargs": dict(self.kwargs), "chat_template_date": self.date}

    def apply(self, messages, add_generation_prompt: bool) -> str:
        from jinja2.exceptions import TemplateError as JinjaError

        try:
            with _clock_at(self.date) if self.reads_clock else nullcontext():
                return self.tokenizer.apply_chat_template(
                    list(messages), tokenize=False, add_generation_prompt=add_generation_prompt, **self.kwargs
                )
        except JinjaError as e:  # raise_exception(...) in the template: it refuses this conversation
            roles = ", ".join(m["role"] for m in messages)
            raise RowProblem("template-refuses", f"the chat template refuses the conversation ({roles}): {e}") from None

    # ---- messages form -------------------------------------------------------------
    def locate_messages(self, messages) -> tuple[str, list[CharRange]]:
        """Render a conversation and return its text and the content range of each Q/A message.

        An assistant turn's range runs from the first character of its reasoning, where the template
        renders it, to the last of its answer: what lies between (``</think>``, harmony's final-channel
        header) is the turn's too, while the marker that opens the reasoning stays structural like a role
        header, whether the template or the row's content wrote it (``rpb.data.reasoning``). A reasoning
        the template does not render is counted in ``self.reasoning``."""
        messages, origin = merge_channels(list(messages))
        turns = [split_turn(m, origin[i]) if m["role"] in A_ROLES else None for i, m in enumerate(messages)]
        probe, parts, k = [], [], 0  # parts: (message, "reasoning" | "answer", sentinel)
        for i, (m, turn) in enumerate(zip(messages, turns, strict=True)):
            if turn is None or turn.reasoning is None:
                probe.append({"role": m["role"], "content": _sentinel(k)})
                parts.append((i, "answer", _sentinel(k)))
                k += 1
                continue
            sr, sa = _sentinel(k), _sentinel(k + 1)
            k += 2
            probe.append(turn.probe(m, sr, sa))
            parts += [(i, "reasoning", sr), (i, "answer", sa)]
        rendered = self.apply(probe, False)
        for i, part, sentinel in parts:
            if part == "answer" and sentinel not in rendered:
                raise RowProblem(
                    "template-drops-content",
                    f"the chat template does not render the content of message {origin[i]} (role-dependent filtering?)",
                    field=f"messages[{origin[i]}].content",
                )
        dropped = [i for i, part, sentinel in parts if part == "reasoning" and sentinel not in rendered]
        kept = [(i, part, sentinel) for i, part, sentinel in parts if sentinel in rendered]
        segments = _split_on_sentinels(rendered, [s for _, _, s in kept])
        text = self.apply(messages, False)
        contents = []
        for i, part, _ in kept:
            turn = turns[i]
            if turn is None:
                contents.append(messages[i]["content"])
            else:
                contents.append(turn.reasoning if part == "reasoning" else turn.answer)
        ranges = _lay_onto_skeleton(text, segments, contents, [origin[i] for i, _, _ in kept])
        if not any(segments):
            raise RowProblem("marker-free", "the chat template rendered no structural text at all")
        self.reasoning.count(turns, dropped)
        by_message: dict[int, tuple[int, int]] = {}
        for (i, _, _), (a, b) in zip(kept, ranges, strict=True):
            lo, hi = by_message.get(i, (a, b))
            by_message[i] = (min(lo, a), max(hi, b))
        spans = [(*by_message[i], _span_of(m["role"])) for i, m in enumerate(messages) if i in by_message]
        return text, [(a, b, s) for a, b, s in spans if s is not None]

    # ---- reference form ------------------------------------------------------------
    @cached_property
    def _reference_skeleton(self) -> dict:
        ss, su, sa = _sentinel(0), _sentinel(1), _sentinel(2)
        user, system, assistant = (
            {"role": "user", "content": su},
            {"role": "system", "content": ss},
            {"role": "assistant", "content": sa},
        )
        try:
            prefix = self.apply([user], True)
        except RowProblem as p:
            raise TemplateError(p.message) from None
        user_only = _split_on_sentinels(prefix, [su])
        with_system = _split_on_sentinels(self.apply([system, user], True), [ss, su])
        full = self.apply([user, assistant], False)
        if not full.startswith(prefix):
            raise TemplateError(
                "the chat template's rendering of [user, assistant] does not start with its rendering of "
                "[user] plus the generation prompt, so reference-form rows cannot be split; use the messages form"
            )
        answer = _split_on_sentinels(full[len(prefix) :], [sa])
        return {"user_only": user_only, "with_system": with_system, "answer": answer}

    def locate_reference(self, row: ReferenceRow) -> tuple[str, list[CharRange]]:
        """Find the user content in ``input`` and the assistant body in ``output``."""
        sk = self._reference_skeleton
        q = _match_single(row.input, sk["user_only"]) or _match_after_system(row.input, sk["with_system"])
        if q is None:
            head, tail = sk["user_only"]
            raise RowProblem(
                "marker-free",
                f"'input' is not a rendered user turn: expected it to start with {head!r} "
                f"(or a rendered system turn) and end with the generation prompt {tail!r}",
                field="input",
            )
        a = _match_single(row.output, sk["answer"])
        if a is None:
            head, tail = sk["answer"]
            raise RowProblem(
                "marker-free",
                f"'output' is not a rendered assistant body: expected it to start with {head!r} "
                f"and end with the turn end {tail!r}",
                field="output",
            )
        offset = len(row.input)
        return row.input + row.output, [(q[0], q[1], SPAN_Q), (offset + a[0], offset + a[1], SPAN_A)]

    def locate(self, row: Row) -> tuple[str, list[CharRange]]:
        if isinstance(row, MessagesRow):
            return self.locate_messages(row.messages)
        return self.locate_reference(row)

    # ---- rendering helper ----------------------------------------------------------
    def render_reference(self, messages) -> tuple[str, str]:
        """Turn a conversation ending in an assistant turn into the reference ``(input, output)``."""
        prefix = self.apply(messages[:-1], True)
        full = self.apply(messages, False)
        if not full.startswith(prefix):
            raise RowProblem(
                "template-prefix-mismatch",
                "the rendered conversation does not start with the rendered prefix (user turn + generation prompt)",
            )
        return prefix, full[len(prefix) :]


def _match_single(text: str, segments: list[str]) -> tuple[int, int] | None:
    head, tail = segments
    if len(text) >= len(head) + len(tail) and text.startswith(head) and text.endswith(tail):
        return len(head), len(text) - len(tail)
    return None


def _match_after_system(text: str, segments: list[str]) -> tuple[int, int] | None:
    head, middle, tail = segments
    if not (text.startswith(head) and text.endswith(tail)):
        return None
    pos = text.find(middle, len(head))
    if pos < 0 or pos + len(middle) > len(text) - len(tail):
        return None
    return pos + len(middle), len(text) - len(tail)


def _shorten(text: str, limit: int = 60) -> str:
    return text if len(text) <= limit else f"{text[: limit // 2]}...{text[-limit // 2 :]}"


def _lay_onto_skeleton(
    text: str, segments: list[str], contents: list[str], messages: list[int] | None = None
) -> list[tuple[int, int]]:
    """Character range of each content in ``text`` given the probe's structural segments.

    Exact when the template inserts contents verbatim (the rendering is then
    seg0 + c0 + seg1 + c1 + ...). Templates that transform content (strip, drop a
    reasoning prefix) are aligned by searching each content, stripped if need be,
    after its leading structural segment.
    """
    exact, cursor = [], 0
    for seg, content in zip(segments, contents, strict=False):
        if text.startswith(seg, cursor) and text.startswith(content, cursor + len(seg)):
            start = cursor + len(seg)
            exact.append((start, start + len(content)))
            cursor = start + len(content)
        else:
            break
    if len(exact) == len(contents) and text[cursor:] == segments[-1]:
        return exact
    ranges, cursor = [], 0
    for i, (seg, content) in enumerate(zip(segments, contents, strict=False)):
        if text.startswith(seg, cursor):
            cursor += len(seg)
        for candidate in (content, content.strip()):
            pos = text.find(candidate, cursor) if candidate else -1
            if pos >= 0:
                ranges.append((pos, pos + len(candidate)))
                cursor = pos + len(candidate)
                break
        else:
            if content.strip():
                index = messages[i] if messages is not None else i
                after = segments[i + 1] if i + 1 < len(segments) else ""
                end = text.find(after, cursor) if after else -1
                region = text[cursor : end if end >= 0 else cursor + len(content)]
                raise RowProblem(
                    "template-mismatch",
                    f"the chat template rewrites the content of message {index}: where the row has "
                    f"{_shorten(content)!r} it renders {_shorten(region)!r}",
                    field=f"messages[{index}].content",
                )
            ranges.append((cursor, cursor))
    return ranges
