"""Tokenizers only the tests use, beside ``rpb.testing.tokenizers.moonlight_tokenizer``.

* ``chatml_tokenizer``: a Qwen3-style ChatML template that inserts an empty think
  block before the final assistant answer; byte-level BPE trained on a fixed corpus,
  so tokens can straddle content boundaries as in real BPE vocabularies.
* ``CharSlowTokenizer``: a pure-Python ("slow") tokenizer without offset mapping,
  like Moonlight's own tiktoken-based one, with Moonlight's template.
"""

from __future__ import annotations

import json
import os
from typing import ClassVar

from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import PreTrainedTokenizer, PreTrainedTokenizerFast

from rpb.testing.tokenizers import MOONLIGHT_SPECIALS, MOONLIGHT_TEMPLATE, PAD, UNK, char_vocab

CHATML_SPECIALS = ["<|im_start|>", "<|im_end|>", "<|endoftext|>"]
CHATML_TEMPLATE = (
    "{%- for message in messages -%}"
    "{{ '<|im_start|>' + message['role'] + '\\n' }}"
    "{%- if message['role'] == 'assistant' and loop.last -%}{{ '<think>\\n\\n</think>\\n\\n' }}{%- endif -%}"
    "{{ message['content'] + '<|im_end|>' + '\\n' }}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}{{ '<|im_start|>assistant\\n' }}{%- endif -%}"
)

_CORPUS = [
    "What is 12 plus 7? The answer is 19.",
    "Sort the list [3, 1, 2]. Sorted: [1, 2, 3].",
    "Reverse the word 'router' -> 'retuor'.",
    "def f(x):\n    return x * 2\n\nprint(f(21))\n",
    "Experts specialise; the router chooses the top k of them for every token.",
    "user\nassistant\nsystem\n<think>\n\n</think>\n\n",
] * 4


def chatml_tokenizer(vocab_size: int = 400) -> PreTrainedTokenizerFast:
    """Byte-level BPE (trained deterministically on a fixed corpus) with a ChatML template."""
    tok = Tokenizer(models.BPE(unk_token=None))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=[PAD, *CHATML_SPECIALS],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(_CORPUS, trainer=trainer)
    return PreTrainedTokenizerFast(
        tokenizer_object=tok,
        pad_token=PAD,
        eos_token="<|im_end|>",
        chat_template=CHATML_TEMPLATE,
        additional_special_tokens=CHATML_SPECIALS,
    )


class CharSlowTokenizer(PreTrainedTokenizer):
    """A pure-Python character tokenizer: no offset mapping, like tiktoken-based slow tokenizers."""

    vocab_files_names: ClassVar[dict] = {"vocab_file": "vocab.json"}
    model_input_names: ClassVar[list] = ["input_ids", "attention_mask"]

    def __init__(self, vocab_file: str | None = None, **kwargs):
        if vocab_file is None:
            self._vocab = char_vocab(MOONLIGHT_SPECIALS)  # the same ids as moonlight_tokenizer()
        else:
            with open(vocab_file, encoding="utf-8") as f:
                self._vocab = json.load(f)
        self._inverse = {i: t for t, i in self._vocab.items()}
        kwargs.setdefault("pad_token", PAD)
        kwargs.setdefault("unk_token", UNK)
        kwargs.setdefault("eos_token", "<|im_end|>")
        kwargs.setdefault("chat_template", MOONLIGHT_TEMPLATE)
        kwargs.setdefault("additional_special_tokens", MOONLIGHT_SPECIALS)
        super().__init__(**kwargs)

    @property
    def vocab_size(self) -> int:
        return len(self._vocab)

    def get_vocab(self) -> dict[str, int]:
        return {**self._vocab, **self.added_tokens_encoder}

    def _tokenize(self, text: str, **kwargs) -> list[str]:
        return list(text)

    def _convert_token_to_id(self, token: str) -> int:
        return self._vocab.get(token, self._vocab[UNK])

    def _convert_id_to_token(self, index: int) -> str:
        return self._inverse.get(index, UNK)

    def convert_tokens_to_string(self, tokens: list[str]) -> str:
        return "".join(tokens)

    def save_vocabulary(self, save_directory: str, filename_prefix: str | None = None) -> tuple[str]:
        path = os.path.join(save_directory, (filename_prefix or "") + "vocab.json")
        with open(path, "w", encoding="utf-8") as f:
            json.dump(self._vocab, f)
        return (path,)
