"""Training only the chosen routed experts of fused expert weights (``[E, ...]`` parameters), so that every
other expert's weights stay bit-identical: LoRA on the chosen experts alone, or full fine-tuning of them alone.

Why masks and not slices: transformers v5 keeps a layer's experts in one fused parameter, so an expert is a
slice of it. Gradients are masked per expert; Adam's update of an entry whose gradient was always 0 is exactly
0 (both moments stay 0), and gradient clipping scales 0 to 0. What is left is weight decay, which AdamW applies
to the whole parameter: for full fine-tuning ``ExpertMask.restrict_decay`` moves each partly chosen parameter
into a group without decay and applies AdamW's decoupled decay (``p *= 1 - lr * wd``, before the step, as
AdamW does) to the chosen experts' slices only. For LoRA, PEFT's ``ParamWrapper`` on a fused parameter holds
``lora_A`` ``[r * E, in]`` (expert e: rows ``e * r`` to ``(e + 1) * r``) and ``lora_B`` ``[out, r * E]``
(expert e: the columns ``c`` with ``c % E == e``); B starts at 0, its unchosen columns never get a gradient,
and decay keeps 0 at 0, so their delta stays exactly 0.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field

import torch
from torch import nn

from rpb.adapters import RouterFacts, find_moe_layers
from rpb.errors import ArgumentError
from rpb.experts.choice import ExpertChoice

LAYER = re.compile(r"(?:^|\.)layers\.(\d+)\.")
#: parameter names of shared (always-on) experts across the families
SHARED = re.compile(r"\.shared_experts?\.")


def check_choice(model: nn.Module, choice: ExpertChoice, facts: RouterFacts) -> int:
    """Refuse a choice that names layers or experts this model does not have (all problems at once); returns E."""
    layers = find_moe_layers(model, facts)
    num_experts = int(layers[0].router.weight.shape[0])
    known = {m.layer_index for m in layers}
    problems = [f"layer {i}: not a MoE layer of this model (MoE layers: {sorted(known)})"
                for i in choice.experts if i not in known]  # fmt: skip
    problems += [f"layer {i}: expert {e} out of range (the model has {num_experts})"
                 for i, ids in choice.experts.items() for e in ids if e >= num_experts]  # fmt: skip
    if problems:
        raise ArgumentError("the expert choice does not fit the model:\n  " + "\n  ".join(problems))
    return num_experts


def _leaf_names(facts: RouterFacts) -> set[str]:
    return {p.rsplit(".", 1)[-1] for p in facts.expert_parameters}


def mask_lora_to_experts(model: nn.Module, choice: ExpertChoice, facts: RouterFacts) -> int:
    """Restrict PEFT's LoRA on the fused expert parameters of ``model`` (a PeftModel) to the chosen experts;
    returns how many wrapped parameters were masked."""
    num_experts = check_choice(model, choice, facts)
    leaves, masked = _leaf_names(facts), 0
    for name, module in model.named_modules():
        match = LAYER.search(name)
        if match is None or getattr(module, "parameter_name", None) not in leaves or module.num_experts != num_experts:
            continue
        keep_E = choice.mask(int(match.group(1)), num_experts)
        for adapter, lora_a in module.lora_A.items():
            a, b = lora_a.weight, module.lora_B[adapter].weight
            rows = keep_E.repeat_interleave(a.shape[0] // num_experts).to(a.device)[:, None].to(a.dtype)
            cols = keep_E.repeat(b.shape[1] // num_experts).to(b.device)[None, :].to(b.dtype)
            with torch.no_grad():
                b.mul_(cols)  # 0 already under PEFT's default init: the unchosen experts' delta is 0 from the start
            a.register_hook(lambda g, m=rows: g * m)
            b.register_hook(lambda g, m=cols: g * m)
        masked += 1
    if masked == 0:
        raise ArgumentError("lora.experts.from: no LoRA-wrapped expert parameter found (is lora.experts on?)")
    return masked


@dataclass
class ExpertMask:
    """Full fine-tuning of the chosen experts: gradient hooks installed; ``restrict_decay`` fits an optimizer."""

    #: (fused parameter, its [E] mask of chosen experts)
    entries: list[tuple[nn.Parameter, torch.Tensor]]
    _decayed: list = field(default_factory=list)
    _optimizers: set = field(default_factory=set)

    def restrict_decay(self, optimizer: torch.optim.Optimizer) -> None:
        """Keep weight decay off the unchosen experts' slices (once per optimizer)."""
        if id(optimizer) in self._optimizers:
            return
        self._optimizers.add(id(optimizer))
        keep = {id(p): k for p, k in self.entries}
        for group in list(optimizer.param_groups):
            wd = group.get("weight_decay", 0.0)
            partial = [p for p in group["params"] if id(p) in keep and not bool(keep[id(p)].all())]
            if not wd or not partial:
                continue
            group["params"] = [p for p in group["params"] if id(p) not in {id(q) for q in partial}]
            new = {**{k: v for k, v in group.items() if k != "params"}, "params": partial, "weight_decay": 0.0}
            optimizer.add_param_group(new)
            self._decayed += [(p, keep[id(p)], wd, new) for p in partial]
        optimizer.register_step_pre_hook(lambda opt, args, kwargs: self._decay())

    @torch.no_grad()
    def _decay(self) -> None:
        for p, keep_E, wd, group in self._decayed:
            if p.grad is not None:  # AdamW skips parameters without a gradient, decay included
                p[keep_E.to(p.device)] *= 1 - group["lr"] * wd


def train_only_experts(model: nn.Module, choice: ExpertChoice, facts: RouterFacts) -> ExpertMask:
    """Freeze what the choice leaves out (non-expert modules and shared experts unless its flags say train them;
    every routed expert it does not name) and mask the fused parameters' gradients to the chosen experts."""
    num_experts = check_choice(model, choice, facts)
    suffixes = tuple(facts.expert_parameters)
    entries = []
    for name, p in model.named_parameters():
        match = LAYER.search(name)
        if name.endswith(suffixes) and match is not None and p.dim() >= 1 and p.shape[0] == num_experts:
            keep_E = choice.mask(int(match.group(1)), num_experts)
            p.requires_grad_(bool(keep_E.any()))
            if keep_E.any():
                mask = keep_E.to(p.device).view((-1,) + (1,) * (p.dim() - 1)).to(p.dtype)
                p.register_hook(lambda g, m=mask: g * m)
                entries.append((p, keep_E))
        elif SHARED.search(f".{name}"):
            p.requires_grad_(choice.shared_experts)
        else:
            p.requires_grad_(choice.non_expert_modules)
    if not entries:
        raise ArgumentError("the expert choice names no routed expert of this model: nothing would train")
    return ExpertMask(entries)
