"""Q / A / structural token labels, derived from each tokenizer's own chat template.

Expectations come from the tokenizer itself (decoding the labelled tokens) and from
hand-written marker strings, never from the labelling code under test.
"""

import itertools
import string

import pytest

from rpb.data.dataset import label_row
from rpb.data.errors import RowProblem
from rpb.data.jsonl import MessagesRow, ReferenceRow
from rpb.data.template import ChatTemplate
from rpb.data.tokens import tokenize_labelled
from rpb.prior import SPAN_A, SPAN_Q, STRUCTURAL
from tests.extra_tokenizers import CharSlowTokenizer


def labelled(tok, messages, max_len=4096):
    return label_row(ChatTemplate(tok), MessagesRow(tuple(messages)), max_len)


def text_of(tok, ids, labels, span):
    """The decoded text of each maximal run of tokens labelled ``span``."""
    runs = []
    for key, group in itertools.groupby(zip(ids, labels, strict=True), key=lambda p: p[1]):
        if key == span:
            runs.append(tok.decode([i for i, _ in group], skip_special_tokens=False))
    return runs


MULTI = [
    {"role": "system", "content": "Be brief."},
    {"role": "user", "content": "What is 2+2?"},
    {"role": "assistant", "content": "4"},
    {"role": "tool", "content": "calculator says 4"},
    {"role": "user", "content": "And 3+3?"},
    {"role": "assistant", "content": "It is 6."},
]


def test_moonlight_single_turn_default_system_prompt_is_structural(moon_tok):
    ids, labels = labelled(moon_tok, [{"role": "user", "content": "Hi there"}, {"role": "assistant", "content": "Yo"}])
    assert text_of(moon_tok, ids, labels, SPAN_Q) == ["Hi there"]
    assert text_of(moon_tok, ids, labels, SPAN_A) == ["Yo"]
    structural = moon_tok.decode([i for i, s in zip(ids, labels, strict=True) if s == STRUCTURAL])
    # every marker, role name and the inserted default system prompt, hand-written:
    assert structural == (
        "<|im_system|>system<|im_middle|>You are a helpful assistant<|im_end|>"
        "<|im_user|>user<|im_middle|><|im_end|><|im_assistant|>assistant<|im_middle|><|im_end|>"
    )


def test_multi_turn_every_user_turn_is_q_every_assistant_turn_is_a(moon_tok, chatml_tok):
    for tok in (moon_tok, chatml_tok):
        ids, labels = labelled(tok, MULTI)
        assert text_of(tok, ids, labels, SPAN_Q) == ["What is 2+2?", "And 3+3?"]
        assert text_of(tok, ids, labels, SPAN_A) == ["4", "It is 6."]
        structural = tok.decode([i for i, s in zip(ids, labels, strict=True) if s == STRUCTURAL])
        assert "Be brief." in structural and "calculator says 4" in structural


def test_chatml_inserted_think_block_is_structural(chatml_tok):
    ids, labels = labelled(
        chatml_tok, [{"role": "user", "content": "Sort [3, 1]."}, {"role": "assistant", "content": "[1, 3]"}]
    )
    assert text_of(chatml_tok, ids, labels, SPAN_A) == ["[1, 3]"]
    structural = chatml_tok.decode([i for i, s in zip(ids, labels, strict=True) if s == STRUCTURAL])
    assert structural == "<|im_start|>user\n<|im_end|>\n<|im_start|>assistant\n<think>\n\n</think>\n\n<|im_end|>\n"


def test_slow_tokenizer_without_offsets_labels_like_the_fast_one(moon_tok, slow_tok):
    assert not slow_tok.is_fast
    assert "offset_mapping" not in slow_tok("abc", return_offsets_mapping=True)  # silently none
    fast_ids, fast_labels = labelled(moon_tok, MULTI)
    slow_ids, slow_labels = labelled(slow_tok, MULTI)
    # both are character-level with the same template: one token per character or marker
    assert len(slow_ids) == len(fast_ids)
    assert slow_labels == fast_labels
    assert text_of(slow_tok, slow_ids, slow_labels, SPAN_Q) == ["What is 2+2?", "And 3+3?"]


class PairSlowTokenizer(CharSlowTokenizer):
    """Slow tokenizer whose tokens are character *pairs*, so tokens straddle content boundaries."""

    def __init__(self, **kwargs):
        chars = list(string.printable)
        vocab = ["<|pad|>", "<|unk|>", *chars, *(a + b for a in chars for b in chars)]
        self._pairs = {t: i for i, t in enumerate(vocab)}
        super().__init__(**kwargs)
        self._vocab, self._inverse = self._pairs, {i: t for t, i in self._pairs.items()}

    def _tokenize(self, text, **kwargs):
        return [text[i : i + 2] for i in range(0, len(text), 2)]


def test_slow_tokenizer_with_straddling_tokens_uses_decoded_offsets():
    tok = PairSlowTokenizer()
    # "system" (6) ... the user content starts right after the "<|im_middle|>" marker; the
    # text between markers is split into pairs, so "user" + "Hello" boundaries fall inside pairs
    # only where the structure has odd length. Build a text by hand to control that:
    text = "ab" + "cHELLOd" + "ef"  # content "HELLO" at chars 3..8
    ranges = [(3, 8, SPAN_Q)]
    ids, labels = tokenize_labelled(tok, text, ranges, 100)
    tokens = tok.convert_ids_to_tokens(ids)
    assert tokens == ["ab", "cH", "EL", "LO", "de", "f"] or tokens == ["ab", "cH", "EL", "LO", "d", "ef"]
    # "cH" and every token with a character of HELLO is Q; "ab" and the tail are structural
    assert labels[:4] == [STRUCTURAL, SPAN_Q, SPAN_Q, SPAN_Q]
    assert all(lab == STRUCTURAL for lab in labels[4:])


def test_reference_form_equals_messages_form(moon_tok, chatml_tok):
    for tok in (moon_tok, chatml_tok):
        msgs = [{"role": "user", "content": "Reverse 'abc'."}, {"role": "assistant", "content": "'cba'"}]
        template = ChatTemplate(tok)
        inp, out = template.render_reference(msgs)
        ref = label_row(template, ReferenceRow(inp, out), 4096)
        assert ref == labelled(tok, msgs)


def test_reference_form_with_a_system_turn(moon_tok):
    msgs = [
        {"role": "system", "content": "You are terse."},
        {"role": "user", "content": "Q?"},
        {"role": "assistant", "content": "A."},
    ]
    template = ChatTemplate(moon_tok)
    inp, out = template.render_reference(msgs)
    ids, labels = label_row(template, ReferenceRow(inp, out), 4096)
    assert text_of(moon_tok, ids, labels, SPAN_Q) == ["Q?"]
    assert text_of(moon_tok, ids, labels, SPAN_A) == ["A."]


def test_reference_form_without_markers_is_refused(moon_tok):
    with pytest.raises(RowProblem) as err:
        label_row(ChatTemplate(moon_tok), ReferenceRow("What is 2+2?", "4"), 4096)
    assert err.value.kind == "marker-free"


def test_truncation_is_on_the_right_and_can_empty_a_span(moon_tok):
    msgs = [{"role": "user", "content": "x" * 30}, {"role": "assistant", "content": "yes"}]
    full_ids, full_labels = labelled(moon_tok, msgs)
    ids, labels = labelled(moon_tok, msgs, max_len=len(full_ids) - 2)  # drops "s" and <|im_end|>
    assert ids == full_ids[:-2] and labels == full_labels[:-2]
    with pytest.raises(RowProblem) as err:
        labelled(moon_tok, msgs, max_len=60)
    assert err.value.kind == "empty-a-span" and "truncation" in err.value.message


def test_template_that_strips_content_is_aligned(moon_tok):
    tok = moonlight_with_template(moon_tok, "{{ message['content'] | trim }}")
    ids, labels = labelled(
        tok, [{"role": "user", "content": "  padded question \n"}, {"role": "assistant", "content": "ok"}]
    )
    assert text_of(tok, ids, labels, SPAN_Q) == ["padded question"]
    assert text_of(tok, ids, labels, SPAN_A) == ["ok"]


def moonlight_with_template(tok, content_expr):
    import copy

    other = copy.deepcopy(tok)
    other.chat_template = tok.chat_template.replace("{{ message['content'] }}", content_expr)
    assert other.chat_template != tok.chat_template
    return other


def test_tokenizer_without_chat_template_is_refused(moon_tok):
    import copy

    tok = copy.deepcopy(moon_tok)
    tok.chat_template = None
    with pytest.raises(ValueError, match="no chat template"):
        ChatTemplate(tok)
