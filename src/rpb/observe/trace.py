"""Reading a model's native routing over data (eval mode, no gradients, bias-free).

``RouterTap`` keeps every MoE layer's native ``(logits, topk_ids)`` of the latest forward;
``route_batch`` runs one collated batch through the decoder stack (the LM head is never
computed). ``trace_topk`` streams a whole example list through a consumer. The shuffled-prior
controls build base co-activation communities from it; the retention diagnostics pair two
models' routing on the very same batches with it; calibration and expert choice read it too.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from tqdm.auto import tqdm

from rpb.adapters import MoELayer, UnsupportedModelError
from rpb.data import Example, collate
from rpb.observe.hooks import Hooks, RouterCall, on_router_calls

#: consumer(layer_pos, topk_ids_TK, logits_TE, valid_T, span_T)
Consumer = Callable[[int, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor], None]


def decoder_of(model: torch.nn.Module) -> torch.nn.Module:
    """The decoder stack of a causal LM (its base model), or the model itself."""
    return getattr(model, getattr(model, "base_model_prefix", ""), model)


class RouterTap:
    """Keeps each router's latest ``logits_TE`` and ``topk_ids_TK`` inside a ``with`` block; unhooked on exit."""

    def __init__(self, layers: list[MoELayer]):
        self.layers = layers
        self.logits: list[torch.Tensor | None] = [None] * len(layers)
        self.topk_ids: list[torch.Tensor | None] = [None] * len(layers)
        self._hooks = Hooks()

    def _keep(self, call: RouterCall) -> None:
        logits, _, topk_ids = call.read()
        if topk_ids is None:
            raise UnsupportedModelError(f"router {call.layer.name} returns no expert indices to trace")
        self.logits[call.pos], self.topk_ids[call.pos] = logits, topk_ids

    def __enter__(self) -> RouterTap:
        self._hooks = on_router_calls(self.layers, self._keep)
        return self

    def __exit__(self, *exc) -> None:
        self._hooks.remove()


@torch.inference_mode()
def route_batch(model: torch.nn.Module, batch: dict) -> None:
    """One eval-mode forward of the decoder stack on a collated batch (see ``rpb.data.collate``)."""
    device = next(model.parameters()).device
    decoder_of(model)(
        input_ids=batch["input_ids"].to(device), attention_mask=batch["attention_mask"].to(device), use_cache=False
    )


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
    tokens = 0
    try:
        with RouterTap(layers) as tap:
            for start in tqdm(range(0, len(examples), batch_size), desc=desc, disable=not progress, unit="batch"):
                b = collate(examples[start : start + batch_size], pad_id)
                route_batch(model, b)
                valid_T, span_T = b["attention_mask"].reshape(-1).bool(), b["span_ids"].reshape(-1)
                for pos in range(len(layers)):
                    ids_TK = tap.topk_ids[pos]
                    consumer(pos, ids_TK, tap.logits[pos], valid_T.to(ids_TK.device), span_T.to(ids_TK.device))
                tokens += int(b["attention_mask"].sum())
    finally:
        model.train(was_training)
    return tokens
