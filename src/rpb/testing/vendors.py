"""Vendors' chat templates as they ship (``templates/``, each file's repository, path, commit and sha256 in
``templates/SOURCES.json``), each with a tokenizer carrying the vendor's special tokens.

The tokenizer is byte-level with one token per byte (no merges), so decoding a labelled run of tokens shows
exactly the characters the labels cover.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

from tokenizers import Tokenizer, decoders, models, pre_tokenizers
from transformers import PreTrainedTokenizerFast

TEMPLATES = Path(__file__).parent / "templates"

#: template -> (bos, eos, other added tokens the template's text does not show as markers)
VENDORS = {
    "kimi_k2": ("[BOS]", "[EOS]", []),
    "deepseek_v3_1": ("<｜begin▁of▁sentence｜>", "<｜end▁of▁sentence｜>", ["<think>", "</think>"]),
    "deepseek_r1": ("<｜begin▁of▁sentence｜>", "<｜end▁of▁sentence｜>", ["<think>", "</think>"]),
    "qwen3": (None, "<|im_end|>", ["<think>", "</think>"]),
    "mixtral": ("<s>", "</s>", []),
    "gpt_oss": ("<|startoftext|>", "<|return|>", []),
    "glm_4_6": (None, "<|endoftext|>", ["[gMASK]", "<sop>", "<think>", "</think>"]),
}
_MARKERS = re.compile(r"<\|[a-z_]+\|>|<｜[^｜]+｜>")


def template_text(name: str) -> str:
    """The template's text, byte for byte (Kimi-K2's has CRLF line ends, which text mode would change)."""
    return (TEMPLATES / f"{name}.jinja").read_bytes().decode("utf-8")


def sources() -> dict:
    """``{file name: {"checkpoint", "repository", "path", "commit", "sha256", "bytes", ...}}`` of every template."""
    return json.loads((TEMPLATES / "SOURCES.json").read_text())


def vendor_tokenizer(name: str) -> PreTrainedTokenizerFast:
    """A byte-level tokenizer with the vendor's bos, eos and marker tokens and its chat template ``name``."""
    if name not in VENDORS:
        raise ValueError(f"no vendored chat template {name!r}; the vendored ones: {', '.join(VENDORS)}")
    bos, eos, extra = VENDORS[name]
    text = template_text(name)
    alphabet = sorted(pre_tokenizers.ByteLevel.alphabet())
    tok = Tokenizer(models.BPE(vocab={c: i for i, c in enumerate(alphabet)}, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tok.decoder = decoders.ByteLevel()
    specials = sorted({*_MARKERS.findall(text), *(t for t in (bos, eos) if t)} - {None})
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok,
        bos_token=bos,
        eos_token=eos,
        pad_token=eos,
        chat_template=text,
        additional_special_tokens=specials,
    )
    fast.add_tokens(extra)
    return fast
