"""``moonlight_tokenizer``: a locally built, character-level fast tokenizer with Moonlight's chat
markers and template (its default system prompt is inserted when none is given). The toy world,
the tests and the benchmarks use it; the tests build other tokenizers beside it.
"""

from __future__ import annotations

import string

from tokenizers import Tokenizer, decoders, models
from transformers import PreTrainedTokenizerFast

MOONLIGHT_SPECIALS = ["<|im_system|>", "<|im_user|>", "<|im_assistant|>", "<|im_middle|>", "<|im_end|>"]
MOONLIGHT_TEMPLATE = (
    "{%- for message in messages -%}"
    "{%- if loop.first and messages[0]['role'] != 'system' -%}"
    "<|im_system|>system<|im_middle|>You are a helpful assistant<|im_end|>"
    "{%- endif -%}"
    "{%- if message['role'] == 'system' -%}<|im_system|>"
    "{%- elif message['role'] == 'user' -%}<|im_user|>"
    "{%- else -%}<|im_assistant|>{%- endif -%}"
    "{{ message['role'] }}<|im_middle|>{{ message['content'] }}<|im_end|>"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}<|im_assistant|>assistant<|im_middle|>{%- endif -%}"
)

CHARSET = list(string.printable)  # letters, digits, punctuation, whitespace (incl. \n)
PAD, UNK = "<|pad|>", "<|unk|>"


def char_vocab(specials: list[str]) -> dict[str, int]:
    tokens = [PAD, UNK, *specials, *CHARSET]
    return {t: i for i, t in enumerate(tokens)}


def moonlight_tokenizer() -> PreTrainedTokenizerFast:
    """Character-level fast tokenizer with Moonlight's chat markers and template."""
    vocab = char_vocab(MOONLIGHT_SPECIALS)
    # BPE without merges and without a pre-tokenizer splits text into single characters.
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[], unk_token=UNK))
    tok.decoder = decoders.Fuse()  # characters join back without separators
    tok.add_special_tokens([PAD, UNK, *MOONLIGHT_SPECIALS])
    return PreTrainedTokenizerFast(
        tokenizer_object=tok,
        pad_token=PAD,
        unk_token=UNK,
        eos_token="<|im_end|>",
        chat_template=MOONLIGHT_TEMPLATE,
        additional_special_tokens=MOONLIGHT_SPECIALS,
    )
