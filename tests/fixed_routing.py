"""Tiny Qwen3-MoE models whose routing is fixed by hand: a table token id -> expert set per MoE layer.

Every attention output projection, the dense layer's MLP and every expert's down projection are zero, so
nothing is ever added to the residual stream: each layer's router sees the RMS-normalised embedding row of
the token itself. The embedding is the identity (hidden size >= vocabulary), so the router's logits for token
v are its weight column v times sqrt(hidden); that column is written from the table so that the logits are
2 + v / 16 for the first expert (token-dependent, so that span means of the router's probabilities, the prior,
have no ties), 1 for the second, 0 for the rest (margins of 1 logit: the selection is certain). Position,
neighbours and padding change nothing. Nothing here imports rpb except the tiny config.

The two tables differ on purpose, so that every subset of tokens (all, Q, A) gives different figures:

* base: first MoE layer (pos 0) pairs {01, 23, 45, 67} by ``v % 4``; second (pos 1) the same pairs by
  ``(v // 4) % 4``;
* post: pos 0 pairs {01, 23, 46, 57} (another partition: the communities change) and the digits and "+" --
  which only questions contain -- one pair further; pos 1 the base's pairs, the lower-case letters (answers
  and the template's words) two pairs further, everything else as the base.

Expert sets are always one of the layer's pairs, so the co-activation graph is a disjoint union of edges:
its Louvain communities are certain (each used pair; an unused pair's experts are singletons).
"""

from __future__ import annotations

from pathlib import Path

import torch
from transformers import AutoModelForCausalLM

from rpb.testing.models import tiny_config

E, K, MOE_LAYERS = 8, 2, (1, 2)  # qwen3_moe tiny: layer 0 is dense (mlp_only_layers)
BASE_PAIRS = ((0, 1), (2, 3), (4, 5), (6, 7))
POST_PAIRS_0 = ((0, 1), (2, 3), (4, 6), (5, 7))

#: (question, answer): questions only digits and "+", answers only lower-case letters and spaces, lengths differ
#: (so batches are padded)
ROWS = [
    ("12+30", "forty two"),
    ("7+8", "fifteen"),
    ("45+45+1", "ninety one"),
    ("3+4+5", "twelve"),
    ("60+9", "sixty nine"),
    ("1+1", "two"),
]


def expert_set(model: str, pos: int, v: int, vocab: dict[str, int]) -> tuple[int, int]:
    """The hand table: the pair of experts ``model`` ("base" or "post") sends token id ``v`` to at MoE layer
    ``pos`` (0 or 1)."""
    digit = v in {vocab[c] for c in "0123456789+"}
    letter = v in {vocab[c] for c in "abcdefghijklmnopqrstuvwxyz"}
    if pos == 0:
        if model == "base":
            return BASE_PAIRS[v % 4]
        return POST_PAIRS_0[(v + 1) % 4 if digit else v % 4]
    shift = 2 if model == "post" and letter else 0
    return BASE_PAIRS[(v // 4 + shift) % 4]


def save_fixed_routing(out: Path, model: str, tok) -> Path:
    """Save a tiny qwen3_moe whose routing is ``expert_set(model, ...)`` and the tokenizer beside it."""
    vocab = tok.get_vocab()
    V = len(tok)
    hidden = 4 * ((V + 3) // 4)  # one embedding dimension per token id
    config = tiny_config("qwen3_moe", vocab_size=V, hidden_size=hidden, num_experts=E, num_experts_per_tok=K)
    torch.manual_seed(0)
    lm = AutoModelForCausalLM.from_config(config)
    decoder = lm.model
    assert [i for i, layer in enumerate(decoder.layers) if hasattr(layer.mlp, "gate")] == list(MOE_LAYERS)
    with torch.no_grad():
        decoder.embed_tokens.weight.copy_(torch.eye(V, hidden))
        for i, layer in enumerate(decoder.layers):
            layer.self_attn.o_proj.weight.zero_()
            if i not in MOE_LAYERS:
                layer.mlp.down_proj.weight.zero_()
                continue
            layer.mlp.experts.down_proj.zero_()
            w_EH = torch.zeros(E, hidden)
            for v in range(V):
                first, second = expert_set(model, MOE_LAYERS.index(i), v, vocab)
                w_EH[first, v], w_EH[second, v] = (2.0 + v / 16) / hidden**0.5, 1.0 / hidden**0.5
            layer.mlp.gate.weight.copy_(w_EH)
    out.mkdir(parents=True, exist_ok=True)
    lm.save_pretrained(out)
    tok.save_pretrained(out)
    return out


def hand_tokens(tok, question: str, answer: str) -> tuple[list[int], list[int], list[int]]:
    """(every token, the question's tokens, the answer's tokens) of one row: the tokens whose characters lie
    inside each content in the rendered conversation (golden layout of the Moonlight template below)."""
    messages = [{"role": "user", "content": question}, {"role": "assistant", "content": answer}]
    text = tok.apply_chat_template(messages, tokenize=False)
    user, assistant = "<|im_user|>user<|im_middle|>", "<|im_end|><|im_assistant|>assistant<|im_middle|>"
    turns = f"{user}{question}{assistant}{answer}<|im_end|>"
    assert text.endswith(turns), text
    q_at = len(text) - len(turns) + len(user)
    a_at = q_at + len(question) + len(assistant)
    enc = tok(text, add_special_tokens=False, return_offsets_mapping=True)
    ids, offsets = list(enc["input_ids"]), [tuple(o) for o in enc["offset_mapping"]]

    def inside(lo: int, hi: int) -> list[int]:
        return [i for i, (a, b) in zip(ids, offsets, strict=True) if lo <= a and b <= hi]

    q_ids, a_ids = inside(q_at, q_at + len(question)), inside(a_at, a_at + len(answer))
    assert len(q_ids) == len(question) and len(a_ids) == len(answer)  # character-level: no token straddles
    return ids, q_ids, a_ids
