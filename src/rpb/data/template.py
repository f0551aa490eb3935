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

import hashlib
from functools import cached_property

from rpb.data.errors import RowProblem
from rpb.data.jsonl import A_ROLES, Q_ROLES, MessagesRow, ReferenceRow, Row
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


class ChatTemplate:
    """The tokenizer's chat template, probed once, used to locate content in rows."""

    def __init__(self, tokenizer):
        if not getattr(tokenizer, "chat_template", None):
            raise TemplateError(
                f"tokenizer {getattr(tokenizer, 'name_or_path', '?')!r} has no chat template; "
                "Q/A spans are derived from it, so one is required"
            )
        self.tokenizer = tokenizer

    @property
    def sha256(self) -> str:
        template = self.tokenizer.chat_template
        if isinstance(template, dict):  # named templates
            template = "\n".join(f"{k}\n{v}" for k, v in sorted(template.items()))
        return hashlib.sha256(template.encode("utf-8")).hexdigest()

    def apply(self, messages, add_generation_prompt: bool) -> str:
        return self.tokenizer.apply_chat_template(
            list(messages), tokenize=False, add_generation_prompt=add_generation_prompt
        )

    # ---- messages form -------------------------------------------------------------
    def locate_messages(self, messages) -> tuple[str, list[CharRange]]:
        """Render a conversation and return its text and the content range of each Q/A message."""
        probe = [{"role": m["role"], "content": _sentinel(i)} for i, m in enumerate(messages)]
        segments = _split_on_sentinels(self.apply(probe, False), [m["content"] for m in probe])
        text = self.apply(messages, False)
        contents = [m["content"] for m in messages]
        ranges = _lay_onto_skeleton(text, segments, contents)
        if not any(segments):
            raise RowProblem("marker-free", "the chat template rendered no structural text at all")
        spans = [(a, b, _span_of(m["role"])) for (a, b), m in zip(ranges, messages, strict=True)]
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
        prefix = self.apply([user], True)
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


def _lay_onto_skeleton(text: str, segments: list[str], contents: list[str]) -> list[tuple[int, int]]:
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
                raise RowProblem(
                    "template-mismatch",
                    f"could not find the content of message {i} in the rendered conversation",
                    field=f"messages[{i}].content",
                )
            ranges.append((cursor, cursor))
    return ranges
