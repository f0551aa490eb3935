"""Training only the chosen routed experts, so that every other expert's parameters stay bit-identical: LoRA on
the chosen experts alone, or full fine-tuning of them alone.

Why masks and not slices: transformers v5 keeps a layer's experts in fused parameters (``[E, ...]``: the weights,
and gpt-oss's per-expert biases), so an expert is a slice of each. Gradients are masked per expert; Adam's update
of an entry whose gradient was always 0 is exactly 0 (both moments stay 0), and gradient clipping scales 0 to 0.
What is left is weight decay, which AdamW applies to the whole parameter: for full fine-tuning
``ExpertMask.restrict_decay`` moves each partly chosen parameter into a group without decay and applies AdamW's
decoupled decay (``p *= 1 - lr * wd``, before the step, as AdamW does) to the chosen experts' slices only. For
LoRA, PEFT's ``ParamWrapper`` on a fused parameter holds ``lora_A`` ``[r * E, in]`` (expert e: rows ``e * r`` to
``(e + 1) * r``) and ``lora_B`` ``[out, r * E]`` (expert e: the columns ``c`` with ``c % E == e``); B starts at 0,
its unchosen columns never get a gradient, and decay keeps 0 at 0, so their delta stays exactly 0.

A mask follows the parameter it acts on (``GradMask``): cast to each gradient's device and dtype (``rpb train``
installs it on the CPU; the Trainer moves the model to the GPU after), and put back on the parameter its module
holds at each forward, where a move replaced the parameter (the ``meta`` device, swapped tensors).
"""

from __future__ import annotations

import logging
import re
import weakref
from collections.abc import Callable
from dataclasses import dataclass, field

import torch
from torch import nn

from rpb.adapters import RouterFacts, find_moe_layers
from rpb.errors import ArgumentError
from rpb.experts.choice import ExpertChoice

logger = logging.getLogger(__name__)

LAYER = re.compile(r"(?:^|\.)layers\.(\d+)\.")
#: parameter names of shared (always-on) experts and their gates (Qwen2-MoE, Qwen3.5-MoE) across the families
SHARED = re.compile(r"\.shared_experts?(?:_gate)?\.")
#: attribute of a parameter: the ids of the GradMasks whose hook it carries
_MARKS = "_rpb_grad_masks"


class GradMask:
    """Multiplies the gradient of the parameter ``find()`` returns by ``mask`` (broadcast against it), cast to the
    gradient's device and dtype. ``owner``'s forward puts the hook back on a parameter that replaced the one it
    was installed on (a parameter keeps its hooks through ``.to(cuda)`` or a dtype cast, not through a move to
    the ``meta`` device or swapped tensors)."""

    def __init__(self, owner: nn.Module, find: Callable[[], nn.Parameter], mask: torch.Tensor):
        self.find, self.mask = find, mask
        self._cast: dict = {}  # the mask per (device, dtype) of the gradients seen
        self.install()
        owner.register_forward_pre_hook(lambda module, args: self.install())

    def install(self) -> None:
        p = self.find()
        marks = p.__dict__.setdefault(_MARKS, set())  # swapped tensors swap __dict__ and hooks together
        if id(self) not in marks:
            p.register_hook(self)
            marks.add(id(self))

    def __call__(self, grad: torch.Tensor) -> torch.Tensor:
        key = (grad.device, grad.dtype)
        if key not in self._cast:
            self._cast[key] = self.mask.to(device=grad.device, dtype=grad.dtype)
        return grad * self._cast[key]


def check_choice(model: nn.Module, choice: ExpertChoice, facts: RouterFacts) -> int:
    """Refuse a choice that names layers or experts this model does not have (all problems at once); returns E."""
    layers = find_moe_layers(model, facts)
    num_experts = int(layers[0].router.weight.shape[0])
    known = {m.layer_index for m in layers}
    problems = [
        f"layer {i}: not a MoE layer of this model (MoE layers: {sorted(known)})"
        for i in choice.experts
        if i not in known
    ]
    problems += [
        f"layer {i}: expert {e} out of range (the model has {num_experts})"
        for i, ids in choice.experts.items()
        for e in ids
        if e >= num_experts
    ]
    if problems:
        raise ArgumentError("the expert choice does not fit the model:\n  " + "\n  ".join(problems))
    return num_experts


def _leaf_names(facts: RouterFacts) -> set[str]:
    return {p.rsplit(".", 1)[-1] for p in facts.expert_parameters}


def routed_expert_parameter(facts: RouterFacts) -> re.Pattern:
    """Names of the routed experts' parameters: everything inside the module(s) holding ``facts``'
    ``expert_parameters`` (group 1: the decoder layer, group 2: the name within that module), biases included."""
    holders = sorted({re.escape(p.rsplit(".", 1)[0]) for p in facts.expert_parameters})
    return re.compile(rf"(?:^|\.)layers\.(\d+)\.(?:{'|'.join(holders)})\.(.+)$")


def mask_lora_to_experts(model: nn.Module, choice: ExpertChoice, facts: RouterFacts) -> int:
    """Restrict PEFT's LoRA on the fused expert parameters of ``model`` (a PeftModel) to the chosen experts;
    returns how many wrapped parameters were masked. The routed experts' other parameters (gpt-oss's biases)
    stay frozen, as PEFT leaves every base parameter."""
    num_experts = check_choice(model, choice, facts)
    if choice.shared_experts or choice.non_expert_modules:
        logger.warning(
            "rpb: lora.experts.from trains LoRA on the chosen routed experts only; the file's "
            "shared_experts / non_expert_modules flags are for train.only_experts"
        )
    leaves, masked = _leaf_names(facts), 0
    for name, module in model.named_modules():
        match = LAYER.search(name)
        if match is None or getattr(module, "parameter_name", None) not in leaves or module.num_experts != num_experts:
            continue
        keep_E = choice.mask(int(match.group(1)), num_experts)
        for adapter in module.lora_A:
            a, b = module.lora_A[adapter].weight, module.lora_B[adapter].weight
            rows = keep_E.repeat_interleave(a.shape[0] // num_experts)[:, None].float()
            cols = keep_E.repeat(b.shape[1] // num_experts)[None, :].float()
            with torch.no_grad():
                b.mul_(cols.to(b.device, b.dtype))  # 0 under PEFT's default init: the unchosen delta is 0 already
            GradMask(module, lambda m=module, k=adapter: m.lora_A[k].weight, rows)
            GradMask(module, lambda m=module, k=adapter: m.lora_B[k].weight, cols)
        masked += 1
    if masked == 0:
        raise ArgumentError("lora.experts.from: no LoRA-wrapped expert parameter found (is lora.experts on?)")
    return masked


@dataclass
class ExpertMask:
    """Full fine-tuning of the chosen experts: gradient masks installed; ``restrict_decay`` fits an optimizer."""

    #: (module, parameter name, its [E] mask of chosen experts) of each routed expert parameter with a chosen expert
    slots: list[tuple[nn.Module, str, torch.Tensor]]
    _fitted: weakref.WeakSet = field(default_factory=weakref.WeakSet)

    @property
    def entries(self) -> list[tuple[nn.Parameter, torch.Tensor]]:
        """(the parameter the module holds now, its [E] mask)."""
        return [(getattr(module, name), keep_E) for module, name, keep_E in self.slots]

    def restrict_decay(self, optimizer: torch.optim.Optimizer) -> None:
        """Keep ``optimizer``'s weight decay off the unchosen experts' slices (once per optimizer). Each optimizer
        decays its own parameters only: one built and thrown away (``rpb audit``'s) leaves nothing behind."""
        if optimizer in self._fitted:
            return
        self._fitted.add(optimizer)
        keep = {id(p): k for p, k in self.entries}
        decayed = []
        for group in list(optimizer.param_groups):
            wd = group.get("weight_decay", 0.0)
            partial = [p for p in group["params"] if id(p) in keep and not bool(keep[id(p)].all())]
            if not wd or not partial:
                continue
            group["params"] = [p for p in group["params"] if id(p) not in {id(q) for q in partial}]
            new = {**{k: v for k, v in group.items() if k != "params"}, "params": partial, "weight_decay": 0.0}
            optimizer.add_param_group(new)
            decayed += [(p, keep[id(p)], wd, new) for p in partial]
        if decayed:
            optimizer.register_step_pre_hook(lambda opt, args, kwargs: _decay(decayed))


@torch.no_grad()
def _decay(decayed: list) -> None:
    """AdamW's decoupled decay on the chosen experts' slices of one optimizer's parameters."""
    for p, keep_E, wd, group in decayed:
        if p.grad is not None:  # AdamW skips parameters without a gradient, decay included
            p[keep_E.to(p.device)] *= 1 - group["lr"] * wd


def train_only_experts(model: nn.Module, choice: ExpertChoice, facts: RouterFacts) -> ExpertMask:
    """Freeze what the choice leaves out (non-expert modules and shared experts with their gates unless its flags
    say train them; every routed expert it does not name) and mask the routed experts' parameters (weights and
    biases, fused ``[E, ...]`` or one module per expert) to the chosen experts."""
    num_experts = check_choice(model, choice, facts)
    routed = routed_expert_parameter(facts)
    modules = dict(model.named_modules())
    slots, problems, trains = [], [], False
    for name, p in model.named_parameters():
        match = routed.search(name)
        if match is None:
            p.requires_grad_(choice.shared_experts if SHARED.search(f".{name}") else choice.non_expert_modules)
            continue
        keep_E, within = choice.mask(int(match.group(1)), num_experts), match.group(2)
        if within.split(".")[0].isdigit():  # one module per expert: experts.<e>.<...>
            p.requires_grad_(bool(keep_E[int(within.split(".")[0])]))
            trains |= p.requires_grad
        elif p.dim() >= 1 and p.shape[0] == num_experts:
            p.requires_grad_(bool(keep_E.any()))
            trains |= p.requires_grad
            if keep_E.any():
                owner_name, leaf = name.rsplit(".", 1)
                owner = modules[owner_name]
                if not keep_E.all():
                    GradMask(owner, lambda m=owner, n=leaf: getattr(m, n), keep_E.view((-1,) + (1,) * (p.dim() - 1)))
                slots.append((owner, leaf, keep_E))
        else:
            problems.append(
                f"{name} {tuple(p.shape)}: among the routed experts, but neither [E={num_experts}, ...] "
                "nor inside one expert's module"
            )
    if problems:
        raise ArgumentError("train.only_experts: parameters it cannot split by expert:\n  " + "\n  ".join(problems))
    if not trains:
        raise ArgumentError("the expert choice names no routed expert of this model: nothing would train")
    return ExpertMask(slots)
