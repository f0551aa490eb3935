"""``anchor.base: online``: the base's routing from a no-grad forward of the base on the step's own batch.

Shape legend: B = rows, S = positions, T = ``B * S`` tokens, L = MoE layers, E = experts, V = vocabulary.

Where the base comes from:

* **LoRA / PEFT** (``adapters-off``): the training model itself with its adapters disabled
  (``PeftModel.disable_adapter``); PEFT puts them back on when the block ends, before the training forward. The
  routers that run are found inside the block (``rpb.adapters.running_router``): a router trained whole under
  ``modules_to_save`` runs its original there, not the trained copy. Adapters merged into the weights leave no
  base to recover, and are refused.
* **full fine-tuning** (``frozen-copy``): a second copy loaded from the checkpoint (``anchor.base_dtype``, default
  the training dtype), frozen, kept in eval mode, moved to the batch's device on first use. Its routers must be the
  training model's as loaded: a model already trained in memory has no base on disk to match, and is refused.

The forward runs in eval mode under ``torch.no_grad``: the training model's anchor, replay and monitor hooks act
on training-mode forwards only, so they pass it by (the adapters-off path flips the model to eval for the block
and restores every module's own flag after). When the step needs the routing alone, the forward stops at the
last MoE router.
"""

from __future__ import annotations

import contextlib
import logging
from dataclasses import dataclass

import torch
from torch import nn

from rpb.adapters import RouterFacts, find_moe_layers, routers_sha256
from rpb.errors import ArgumentError
from rpb.observe.capture import RouterCapture
from rpb.teacher.routing import BaseRouting

logger = logging.getLogger("rpb.teacher")

#: the batch keys a causal LM's forward takes from a training batch (labels aside: the base computes no loss)
FORWARD_KEYS = ("input_ids", "attention_mask", "position_ids")


def _peft_merged(model: nn.Module) -> bool:
    """Whether any PEFT layer of ``model`` has its adapter merged into the base weights (duck-typed)."""
    return any(bool(getattr(m, "merged", False)) for m in model.modules() if hasattr(m, "merged_adapters"))


def is_peft(model: nn.Module) -> bool:
    return callable(getattr(model, "disable_adapter", None)) and hasattr(model, "peft_config")


def dtype_problems(dtype: str | None, device: torch.device) -> list[str]:
    """Why the frozen copy cannot run in ``dtype`` on ``device`` (empty: it can)."""
    from rpb.models import DTYPES

    if dtype is None:
        return []
    if dtype not in DTYPES:
        return [f"anchor.base_dtype: one of {list(DTYPES)}, got {dtype!r}"]
    if dtype == "bfloat16" and device.type == "cuda" and not torch.cuda.is_bf16_supported():
        return [f"anchor.base_dtype: bfloat16, which this GPU ({torch.cuda.get_device_name(device)}) cannot run"]
    return []


@dataclass
class OnlineBase:
    """The base's forward for each step (see the module doc). ``mode``: ``adapters-off`` or ``frozen-copy``."""

    mode: str
    facts: RouterFacts
    #: the PEFT model (adapters-off) or the frozen copy (frozen-copy)
    module: nn.Module
    #: the base's next-token logits are wanted too (``output-kd``): the forward runs to the end
    outputs: bool = False

    @property
    def copy_bytes(self) -> int:
        """Memory the base takes besides the training model (the frozen copy's parameters and buffers)."""
        if self.mode != "frozen-copy":
            return 0
        tensors = [*self.module.parameters(), *self.module.buffers()]
        return sum(t.numel() * t.element_size() for t in tensors)

    def describe(self) -> dict:
        out = {"source": "online", "mode": self.mode, "copy_bytes": self.copy_bytes}
        if self.mode == "frozen-copy":
            out["dtype"] = str(next(self.module.parameters()).dtype).removeprefix("torch.")
        return out

    @torch.no_grad()
    def step(self, inputs: dict, hidden: bool = False) -> BaseRouting:
        """The base's routing (and, with ``outputs``, its next-token logits; with ``hidden``, each router's input,
        for ``hidden-kd``) on the batch ``inputs``."""
        kwargs = {k: inputs[k] for k in FORWARD_KEYS if inputs.get(k) is not None}
        device = kwargs["input_ids"].device
        with self._base_mode(device) as model:
            layers = find_moe_layers(model, self.facts)  # the routers that run with the adapters off
            capture = RouterCapture(layers, stop_early=not self.outputs, hidden=hidden)
            logits_LTE, out = capture.run(lambda: model(**kwargs, use_cache=False))
        output_BTV = out.logits.float() if self.outputs else None
        return BaseRouting(logits_LTE=logits_LTE, output_BTV=output_BTV, hidden_LTH=capture.hidden_LTH)

    @contextlib.contextmanager
    def _base_mode(self, device: torch.device):
        if self.mode == "frozen-copy":
            if next(self.module.parameters()).device != device:
                self.module.to(device)
            yield self.module
            return
        model = self.module
        if _peft_merged(model):
            raise ArgumentError(
                "anchor.base=online: the LoRA adapters are merged into the weights, so the base's weights cannot be "
                "recovered by disabling them; unmerge them (or use anchor.base=routes)"
            )
        flags = {m: m.training for m in model.modules()}
        try:
            model.eval()
            with model.disable_adapter():
                yield model
        finally:
            for m, flag in flags.items():
                m.training = flag


def online_base(
    model: nn.Module,
    facts: RouterFacts,
    *,
    model_id: str | None,
    dtype: str | None,
    outputs: bool,
    experts_implementation: str | None = None,
) -> OnlineBase:
    """The online base for ``model`` (after LoRA wrapping, before training). Under PEFT: the adapters-off path;
    otherwise a frozen copy loaded from ``model_id`` in ``dtype`` (None: the model's own) with the training model's
    experts kernel, its routers checked against the model's."""
    if is_peft(model):
        if _peft_merged(model):
            raise ArgumentError(
                "anchor.base=online: the model's LoRA adapters are merged into its weights; the base cannot be "
                "recovered by disabling them (unmerge, or use anchor.base=routes)"
            )
        return OnlineBase("adapters-off", facts, model, outputs)
    from rpb.models import load_causal_lm

    if model_id is None:
        raise ArgumentError(
            "anchor.base=online under full fine-tuning loads a frozen copy of the base from its checkpoint: give "
            "model_id (the checkpoint the model was loaded from)"
        )
    device = next(model.parameters()).device
    own = str(next(model.parameters()).dtype).removeprefix("torch.")
    problems = dtype_problems(dtype, device)
    if problems:
        raise ArgumentError("; ".join(problems))
    copy = load_causal_lm(model_id, dtype or own, experts_implementation)
    copy.requires_grad_(False).eval().to(device)
    here, there = (
        routers_sha256(find_moe_layers(model, facts), facts),
        routers_sha256(find_moe_layers(copy, facts), facts),
    )
    if here != there:
        raise ArgumentError(
            f"anchor.base=online: the model in memory is not the checkpoint {model_id!r} (router fingerprint "
            f"{here[:16]}… against the checkpoint's {there[:16]}…): trained already, so its base cannot be "
            "recovered; start from the checkpoint, or use anchor.base=routes with routes of the base"
        )
    base = OnlineBase("frozen-copy", facts, copy, outputs)
    logger.info("rpb: anchor.base=online keeps a frozen copy of the base (%.1f MiB)", base.copy_bytes / 2**20)
    return base
