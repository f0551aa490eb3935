"""A GRPO run with TRL's tool loop on a tiny model: a character-level tokenizer with TRL's own Qwen3 chat template
(whose tool-call parser TRL installs), and a logits processor of the test's own that makes chosen rollouts call
the tool in their first turn (a random tiny model would never write one), so that TRL runs the tool and generates
again after its result."""

from __future__ import annotations

import datasets
import torch
from tokenizers import Tokenizer, decoders, models
from transformers import LogitsProcessor, LogitsProcessorList, PreTrainedTokenizerFast
from trl.chat_template_utils import qwen3_chat_template

from rpb.testing.tokenizers import PAD, UNK, char_vocab

SPECIALS = ["<|im_start|>", "<|im_end|>", "<|endoftext|>"]
#: the first turn of a tool-calling rollout, as Qwen3's template writes a call
CALL = '<tool_call>\n{"name": "add", "arguments": {"a": 1, "b": 2}}\n</tool_call><|im_end|>'
PROMPTS = ["add one and two", "hello", "what is 1 + 2", "abc"]


def add(a: int, b: int) -> int:
    """Add two integers.

    Args:
        a: the first.
        b: the second.
    """
    return a + b


def qwen3_char_tokenizer() -> PreTrainedTokenizerFast:
    vocab = char_vocab(SPECIALS)
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[], unk_token=UNK))
    tok.decoder = decoders.Fuse()
    tok.add_special_tokens([PAD, UNK, *SPECIALS])
    out = PreTrainedTokenizerFast(tokenizer_object=tok, pad_token=PAD, unk_token=UNK, eos_token="<|im_end|>",
                                  chat_template=qwen3_chat_template, additional_special_tokens=SPECIALS)  # fmt: skip
    out.padding_side = "left"
    return out


class CallTheTool(LogitsProcessor):
    """Rows ``rows`` of a first turn write ``CALL``, token by token; every other row and turn is the model's."""

    def __init__(self, forced: list[int], prompt_len: int, rows: list[int]):
        self.forced, self.prompt_len, self.rows = forced, prompt_len, rows

    def __call__(self, input_ids, scores):
        step = input_ids.shape[1] - self.prompt_len
        if step < len(self.forced):
            for b in self.rows:
                scores[b] = float("-inf")
                scores[b, self.forced[step]] = 0.0
        return scores


def make_rollouts_call(model, tok, rows: list[int]) -> None:
    """``model.generate`` with ``CallTheTool`` on a first turn (a prompt without a tool's response yet)."""
    forced = tok(CALL, add_special_tokens=False)["input_ids"]
    generate = model.generate
    response = tok("<tool_response>", add_special_tokens=False)["input_ids"]

    def first_turn(ids_BP) -> bool:
        text = ids_BP[0].tolist()
        return not any(text[i : i + len(response)] == response for i in range(len(text)))

    def generate_calling(*args, **kwargs):
        ids_BP = kwargs["input_ids"]
        if first_turn(ids_BP):
            kwargs["logits_processor"] = LogitsProcessorList([CallTheTool(forced, ids_BP.shape[1], rows)])
        return generate(*args, **kwargs)

    model.generate = generate_calling


def tool_dataset() -> datasets.Dataset:
    return datasets.Dataset.from_list([{"prompt": [{"role": "user", "content": p}]} for p in PROMPTS])


def watch_routers(model, layers) -> tuple[dict, list]:
    """The experts each MoE layer's router chose in every training forward with gradients (a hook of the test's
    own on the experts module: what the experts received), [T, K] per layer, in call order."""
    seen: dict[int, list[torch.Tensor]] = {}

    def hook_for(pos):
        def hook(module, args):
            if module.training and torch.is_grad_enabled():
                seen.setdefault(pos, []).append(args[1].detach().clone())

        return hook

    handles = [
        model.get_submodule(m.name.rpartition(".")[0] + ".experts").register_forward_pre_hook(hook_for(p))
        for p, m in enumerate(layers)
    ]
    return seen, handles


def watch_policy_forwards(model, layers) -> tuple[list[dict], list]:
    """Every forward of ``model`` that scores tokens (TRL passes ``labels`` to its scoring and training forwards,
    never to generation's): its padded ``input_ids``, whether it ran with gradients, and per MoE layer the experts
    its experts module received ([B, S, K], a hook of the test's own)."""
    forwards: list[dict] = []

    def before(module, args, kwargs):
        ids = kwargs.get("input_ids", args[0] if args else None)
        scoring = "labels" in kwargs
        forwards.append({"ids": ids.clone(), "grad": torch.is_grad_enabled(), "experts": {}, "scores": scoring})

    def experts_for(pos):
        def hook(module, args):
            f = forwards[-1] if forwards else None
            if f is not None and f["scores"] and pos not in f["experts"]:  # a recomputation adds nothing
                B, S = f["ids"].shape
                f["experts"][pos] = args[1].detach().reshape(B, S, -1).clone()

        return hook

    handles = [model.register_forward_pre_hook(before, with_kwargs=True)]
    handles += [
        model.get_submodule(m.name.rpartition(".")[0] + ".experts").register_forward_pre_hook(experts_for(p))
        for p, m in enumerate(layers)
    ]
    return forwards, handles
