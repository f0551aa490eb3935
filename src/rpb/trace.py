"""Tracing a model's native routing over data (eval mode, no gradients, bias-free).

``trace_topk`` runs batches of labelled examples through the decoder stack (no LM head)
and hands each MoE layer's native top-k choices, with the mask of the tokens that count,
to a consumer. The shuffled-prior controls build base co-activation communities from it;
the retention diagnostics compare base and post-training routing with it.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from tqdm.auto import tqdm

from rpb.adapters import MoELayer
from rpb.data import Example, collate

#: consumer(layer_pos, topk_ids_TK, logits_TE, valid_T, span_T)
Consumer = Callable[[int, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor], None]


def decoder_of(model: torch.nn.Module) -> torch.nn.Module:
    """The decoder stack of a causal LM (its base model), or the model itself."""
    return getattr(model, getattr(model, "base_model_prefix", ""), model)


@torch.inference_mode()
def trace_topk(
    model: torch.nn.Module,
    layers: list[MoELayer],
    examples: list[Example],
    consumer: Consumer,
    batch_size: int = 8,
    pad_id: int = 0,
    progress: bool = False,
    desc: str = "trace",
) -> int:
    """Feed every layer's native routing on ``examples`` to ``consumer``; returns the tokens counted."""
    was_training = model.training
    model.eval()
    state: dict = {}

    def hook(pos):
        def fn(module, args, output):
            logits_TE, _, topk_ids_TK = output
            consumer(pos, topk_ids_TK, logits_TE, state["valid_T"], state["span_T"])

        return fn

    handles = [m.router.register_forward_hook(hook(i)) for i, m in enumerate(layers)]
    device = next(model.parameters()).device
    tokens = 0
    try:
        decoder = decoder_of(model)
        for start in tqdm(range(0, len(examples), batch_size), desc=desc, disable=not progress, unit="batch"):
            b = collate(examples[start : start + batch_size], pad_id)
            state["valid_T"] = b["attention_mask"].reshape(-1).bool().to(device)
            state["span_T"] = b["span_ids"].reshape(-1).to(device)
            decoder(input_ids=b["input_ids"].to(device), attention_mask=b["attention_mask"].to(device), use_cache=False)
            tokens += int(b["attention_mask"].sum())
    finally:
        for h in handles:
            h.remove()
        model.train(was_training)
    return tokens
