"""LoRA with PEFT (``pip install 'rpb[peft]'``): the ``lora:`` section of ``rpb train``, and saving.

In transformers v5 the routed experts' weights are fused parameters, so LoRA reaches them by
parameter (PEFT's ``target_parameters``); the attention projections are Linear modules
(``target_modules``). The router is frozen, trained whole (``modules_to_save``: PEFT trains a
copy, which is what runs) or given LoRA on its weight (by parameter). The anchors find the
router that runs in every case (``rpb.adapters.running_router``) and their loss terms read its
*effective* weight, base plus delta (PEFT swaps it in during the forward).

The anchor goes in after ``get_peft_model``: PEFT replaces or copies the router modules.

PEFT freezes every base weight, so a wrapped model no longer shows which routers the user had frozen before.
``apply_lora`` records them on the model it returns (their decoder-layer indices), which ``rpb audit`` reads
(``rpb.monitor.asked.routers_frozen_before_lora``) to hold such a router frozen even where PEFT wraps it. The
record is a plain attribute of the PEFT wrapper (``asked.FROZEN_ROUTERS``): ``merge_and_unload`` drops it with the
wrapper, and deleting the attribute undoes it.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Literal

from torch import nn

from rpb.adapters import RouterFacts, find_moe_layers
from rpb.monitor import asked

RouterTraining = Literal["none", "full", "lora"]
#: every Linear under a decoder layer's attention, its norms aside (MLA's q_a_layernorm, kv_a_layernorm)
ATTENTION_MODULES = r".*\.self_attn\.(?!\w*norm)\w+"


@dataclass
class LoraSection:
    """``lora:``: LoRA adapters instead of full fine-tuning; off while ``rank`` is 0."""

    #: LoRA rank r; 0 = no LoRA (full fine-tuning)
    rank: int = 0
    #: the update is (alpha / rank) * B @ A
    alpha: float = 16.0
    #: dropout on the LoRA input (0 keeps runs comparable bit for bit)
    dropout: float = 0.0
    #: LoRA on the attention projections
    attention: bool = True
    #: LoRA on the routed experts' fused weights (by parameter): true (every expert), false, or
    #: {from: experts.json} (only the experts an ESFT-style expert config names: ``rpb experts``)
    experts: bool | dict = True
    #: the router: "none" (frozen), "full" (trained whole, PEFT modules_to_save) or "lora" (LoRA on its weight)
    router: RouterTraining = "none"
    #: after training, merge the adapters and save a plain transformers checkpoint; false: save the adapter alone
    merge: bool = True

    @property
    def enabled(self) -> bool:
        return self.rank > 0

    def problems(self) -> list[str]:
        out = []
        if self.rank < 0:
            out.append(f"lora.rank: must be >= 0 (0 = off), got {self.rank}")
        if self.enabled and not (self.attention or self.experts or self.router != "none"):
            out.append("lora: nothing to train (attention, experts and router all off)")
        if not 0 <= self.dropout < 1:
            out.append(f"lora.dropout: must be in [0, 1), got {self.dropout}")
        chosen = self.experts if isinstance(self.experts, dict) else None
        if chosen is not None and (set(chosen) != {"from"} or not isinstance(chosen["from"], str)):
            out.append(f"lora.experts: true, false or {{from: <expert config JSON>}}, got {self.experts!r}")
        return out

    @property
    def experts_from(self) -> str | None:
        """The expert config restricting LoRA to chosen experts (None: every expert, or none)."""
        return self.experts["from"] if isinstance(self.experts, dict) else None


def lora_config(section: LoraSection, facts: RouterFacts):
    """The ``peft.LoraConfig`` for ``section`` on a model of ``facts``' family."""
    from peft import LoraConfig

    parameters = list(facts.expert_parameters) if section.experts else []
    if section.router == "lora":
        parameters.append(f"{facts.router_module}.weight")
    return LoraConfig(
        r=section.rank,
        lora_alpha=section.alpha,
        lora_dropout=section.dropout,
        target_modules=ATTENTION_MODULES if section.attention else [],
        target_parameters=parameters or None,
        modules_to_save=[facts.router_module] if section.router == "full" else None,
        task_type="CAUSAL_LM",
    )


def apply_lora(model: nn.Module, section: LoraSection, facts: RouterFacts) -> nn.Module:
    """``model`` wrapped by PEFT per ``section`` (install the anchor on what this returns)."""
    from peft import get_peft_model

    frozen = tuple(m.layer_index for m in find_moe_layers(model, facts) if not m.trainable)
    wrapped = get_peft_model(model, lora_config(section, facts))
    setattr(wrapped, asked.FROZEN_ROUTERS, frozen)
    if section.experts_from is not None:
        from rpb.experts import mask_lora_to_experts, read_choice

        mask_lora_to_experts(wrapped, read_choice(section.experts_from), facts)
    return wrapped


def save_lora(model: nn.Module, out: str | Path, merge: bool) -> nn.Module:
    """Merge and save a plain transformers checkpoint (``from_pretrained`` loads it without PEFT), or save
    the adapter alone; returns the model that was saved."""
    if merge:
        model = model.merge_and_unload()
    model.save_pretrained(str(out))
    return model
