"""Moonlight's tokenizer as its checkpoint directory ships it, in miniature: ``tiktoken.model`` (ranks trained
here with tiktoken's own trainer on a fixed corpus with the Kimi line's split pattern; the real file's 163,584
ranks cannot be downloaded here), ``tokenizer_config.json`` with ``auto_map`` and the special tokens Moonlight and
Kimi-K2 name at their places after the ranks, and the remote module: tests/fixtures/moonshot's stand-in."""

from __future__ import annotations

import base64
import json
import shutil
from functools import cache
from pathlib import Path

from rpb.testing.vendors import template_text

STANDIN = Path(__file__).parent / "fixtures" / "moonshot" / "tokenization_moonshot.py"
#: offset after the ranks -> token, as Moonlight-16B-A3B-Instruct and Kimi-K2 place them (163584 + offset)
SPECIALS = {0: "[BOS]", 1: "[EOS]", 2: "<|im_end|>", 3: "<|im_user|>", 4: "<|im_assistant|>",
            6: "<|start_header_id|>", 7: "<|end_header_id|>", 9: "[EOT]", 10: "<|im_system|>", 17: "<|im_middle|>",
            254: "[UNK]", 255: "[PAD]"}  # fmt: skip
_CORPUS = (
    "What is 2+2? It is 4. And 3+3? Six. Answer briefly. Two and two make four. Three doubled. "
    "You are a helpful assistant. The router's experts: HTTPServer, CamelCase, don't, we'll, 12345 678. "
    "专家路由 mixture of experts\n\n  indented\n<think>\nreasoning\n</think>\n\n"
) * 3


@cache
def ranks() -> dict[bytes, int]:
    from tiktoken._educational import bpe_train

    pattern = standin_pattern()
    # trained with the regex module in its V1 mode, where [..&&..] is a set intersection as in tiktoken's
    return bpe_train(_CORPUS, 256 + 100, "(?V1)" + pattern, visualise=None)


def standin_pattern() -> str:
    """The split pattern, read from the stand-in's source (the module cannot be imported before rpb's shim)."""
    namespace: dict = {}
    source = STANDIN.read_text()
    start = source.index("PATTERN = ")
    exec(source[start : source.index("\n#: ", start)], namespace)  # only the pattern's assignment
    return namespace["PATTERN"]


def moonshot_tokenizer_dir(path: Path, chat_template: str | None = None) -> Path:
    """Write the directory; its chat template defaults to Kimi-K2's as shipped (rpb/testing/templates)."""
    path.mkdir(parents=True, exist_ok=True)
    table = ranks()
    by_rank = sorted(table.items(), key=lambda kv: kv[1])
    (path / "tiktoken.model").write_text("".join(f"{base64.b64encode(t).decode()} {rank}\n" for t, rank in by_rank))
    first = len(table)
    config = {
        "added_tokens_decoder": {
            str(first + k): {
                "content": t,
                "lstrip": False,
                "normalized": False,
                "rstrip": False,
                "single_word": False,
                "special": True,
            }
            for k, t in SPECIALS.items()
        },
        "additional_special_tokens": [
            "<|im_end|>",
            "<|im_user|>",
            "<|im_assistant|>",
            "<|start_header_id|>",
            "<|end_header_id|>",
            "[EOT]",
            "<|im_system|>",
            "<|im_middle|>",
        ],
        "auto_map": {"AutoTokenizer": ["tokenization_moonshot.TikTokenTokenizer", None]},
        "bos_token": "[BOS]",
        "eos_token": "[EOS]",
        "pad_token": "[PAD]",
        "unk_token": "[UNK]",
        "chat_template": chat_template if chat_template is not None else template_text("kimi_k2"),
        "clean_up_tokenization_spaces": False,
        "model_max_length": 8192,
        "tokenizer_class": "TikTokenTokenizer",
    }
    (path / "tokenizer_config.json").write_text(json.dumps(config, indent=2))
    shutil.copy(STANDIN, path / "tokenization_moonshot.py")
    return path
