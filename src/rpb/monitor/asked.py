"""What a training set-up asks of its routers (``rpb audit``), read from an ``rpb train`` configuration or from
the model as the user left it. An ``Asked`` handed to ``audit`` overrides what is read here.

From the model, per MoE layer: a router counts as frozen when PEFT does not wrap it and none of its parameters
requires a gradient. PEFT freezes every base weight, so a router it wraps (a trainable copy, LoRA on its weight)
cannot show whether it was frozen on purpose before: rpb's ``lora:`` path records which routers were frozen
before it wrapped (``routers_frozen_before_lora``), and those count as frozen. On a model the user
wrapped there is no record: its wrapped routers count as free, with one warning naming the ``Asked`` field that
says otherwise. The model's native load-balancing loss is asked where its config turns it on
(``output_router_logits`` with ``router_aux_loss_coef`` > 0); an rpb anchor asks it off.
"""

from __future__ import annotations

import logging

from rpb.adapters import MoELayer
from rpb.anchors import get_method
from rpb.monitor.verdict import Asked

logger = logging.getLogger(__name__)

#: attribute of a model ``rpb.train.lora.apply_lora`` wrapped: the decoder-layer indices of the routers frozen
#: before the wrap, which the audit reads (PEFT's wrap hides it)
FROZEN_ROUTERS = "rpb_routers_frozen_before_lora"


def routers_frozen_before_lora(model) -> tuple[int, ...] | None:
    """The decoder-layer indices of the routers that had no trainable parameter when ``apply_lora`` wrapped
    ``model`` (None: ``apply_lora`` did not wrap it)."""
    return vars(model).get(FROZEN_ROUTERS)


def asked_from_config(cfg) -> Asked:
    """What an ``rpb train`` configuration asks: the router frozen by ``router-freeze``, by LoRA that leaves it
    out, or by ``train.only_experts`` (a non-expert module unless the choice file's ``non_expert_modules`` is
    true); the method as the anchor (``sft`` anchors nothing); never a native auxiliary loss."""
    method = get_method(cfg.anchor.method)
    frozen = method.freeze_router or (cfg.lora.enabled and cfg.lora.router == "none")
    if cfg.train.only_experts:
        from rpb.experts.choice import read_choice

        frozen = frozen or not read_choice(cfg.train.only_experts).non_expert_modules
    return Asked("frozen" if frozen else "free", _anchoring(method), native_aux=False)


def asked_from_model(model, layers: list[MoELayer], handle=None) -> Asked:
    """What the model as the user left it asks (``handle``: an rpb anchor installed on it, or None): the routers
    frozen as ``frozen_routers`` finds them (all of them by a ``router-freeze`` anchor); with an rpb anchor, its
    method and no native auxiliary loss, else the native loss as the model's config sets it."""
    method = handle.method if handle is not None else None
    frozen = frozen_routers(model, layers)
    if (method is not None and method.freeze_router) or len(frozen) == len(layers):
        router, frozen_layers = "frozen", ()
    else:
        router, frozen_layers = "free", tuple(sorted(frozen))
    if method is not None:
        return Asked(router, _anchoring(method), native_aux=False, frozen_layers=frozen_layers)
    return Asked(router, native_aux=native_aux_of(model), frozen_layers=frozen_layers)


def frozen_routers(model, layers: list[MoELayer]) -> set[int]:
    """The decoder-layer indices of the routers left frozen: unwrapped and without a trainable parameter, or
    wrapped by rpb's ``lora:`` path after being frozen. A user's PEFT wrap of a router: counted free, warned."""
    record = routers_frozen_before_lora(model)
    out = set()
    for m in layers:
        if m.wrapper is None:
            if not any(p.requires_grad for p in m.router.parameters()):
                out.add(m.layer_index)
        elif record is not None and m.layer_index in record:
            out.add(m.layer_index)
    wrapped = [m.layer_index for m in layers if m.wrapper is not None]
    if record is None and wrapped:
        logger.warning(
            "rpb audit: PEFT wraps the routers of MoE layers %s in a model rpb's lora: path did not wrap, so the "
            "audit cannot tell whether they were frozen before; it counts them free. If they were meant frozen, "
            'pass audit(trainer, Asked(router="frozen"))',
            wrapped,
        )
    return out


def native_aux_of(model) -> bool | None:
    """Whether the model's config adds its own load-balancing loss (None: the config has no switch for one)."""
    base = model.get_base_model() if callable(getattr(model, "get_base_model", None)) else model
    config = getattr(base, "config", None)
    text = config.get_text_config() if hasattr(config, "get_text_config") else config
    if text is None or not hasattr(text, "output_router_logits"):
        return None
    coefficient = getattr(text, "router_aux_loss_coef", None) or 0.0
    return bool(text.output_router_logits) and coefficient > 0


def _anchoring(method) -> str | None:
    """The method's name where it acts on the routing (a selection or a loss term); ``sft`` and
    ``router-freeze`` anchor nothing."""
    return method.name if method.selection is not None or method.loss is not None else None
