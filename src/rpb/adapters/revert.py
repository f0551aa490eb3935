"""One model's routers put into another: the base's back into a post-trained model (``rpb retention
--revert-routers``), or the other way round.

What is put is what decides the routing, as the family's facts name it (``rpb.adapters.fingerprint.router_tensors``):
the router's weight, its bias where the family has one (gpt-oss) and the expert-correction bias, a buffer, the
router's or (MiniMax-M2) its MoE block's; the MoE block's shared-expert gate (Qwen2-MoE, Qwen3.5-MoE) only
when asked, as it weighs the shared expert and chooses no routed one. Nothing else is touched. Each tensor is
copied in place, in the receiving model's dtype, so "bit for bit" means the source's values in that dtype. A
PEFT-wrapped router must be merged first (the wrapper's factors would still move it).
"""

from __future__ import annotations

import contextlib

import torch
from torch import nn

from rpb.adapters.fingerprint import router_tensors
from rpb.adapters.hf import RouterFacts, find_moe_layers
from rpb.errors import ArgumentError


def _tensors(model: nn.Module, layer, facts: RouterFacts, shared_gates: bool) -> dict[str, torch.Tensor | None]:
    """``router_tensors``, plus (``shared_gates``, where the family has one) the block's shared-expert gate weight
    under ``<gate>.weight``."""
    found = dict(router_tensors(layer, facts))
    if shared_gates and facts.shared_gate is not None:
        gate = getattr(model.get_submodule(layer.name.rpartition(".")[0]), facts.shared_gate, None)
        found[f"{facts.shared_gate}.weight"] = None if gate is None else gate.weight
    return found


def put_routers(
    into: nn.Module,
    source: nn.Module,
    facts: RouterFacts,
    names: tuple[str, str] = ("post", "base"),
    shared_gates: bool = False,
) -> list[str]:
    """Copy every MoE router of ``source`` into ``into`` (both of ``facts``' family), in place; returns the names
    of the tensors copied, as ``into``'s state dict names them (``<router module>.<tensor>``; a tensor the MoE
    block holds, MiniMax-M2's expert-correction bias or a shared-expert gate's weight, ``<block>.<tensor>``).
    Refused before anything is copied, every difference named: other MoE layers, a tensor one of them lacks,
    other shapes. ``names``: what the messages call the two models; ``shared_gates``: the blocks' shared-expert
    gates too."""
    dst, src = find_moe_layers(into, facts), find_moe_layers(source, facts)
    problems = []
    if [m.layer_index for m in dst] != [m.layer_index for m in src]:
        problems.append(
            f"MoE layers: the {names[0]} model has {[m.layer_index for m in dst]}, the {names[1]} model "
            f"{[m.layer_index for m in src]}"
        )
    pairs = []
    for d, s in zip(dst, src, strict=False):
        theirs, ours = _tensors(source, s, facts, shared_gates), _tensors(into, d, facts, shared_gates)
        for name, t in ours.items():
            if theirs[name] is None or t is None:
                lacking = names[1] if t is not None else names[0]
                problems.append(f"layer {d.layer_index}: {name} missing in the {lacking} model")
            elif theirs[name].shape != t.shape:
                problems.append(
                    f"layer {d.layer_index}: {name} of shape {list(t.shape)} in the {names[0]} model, "
                    f"{list(theirs[name].shape)} in the {names[1]} model"
                )
            else:
                on_block = name.startswith(f"{facts.shared_gate}.") or (
                    facts.expert_bias_on_block and name == facts.expert_bias
                )
                owner = d.name.rpartition(".")[0] if on_block else d.name
                pairs.append((f"{owner}.{name}", t, theirs[name]))
    if problems:
        raise ArgumentError(
            f"the routers of the two models differ, nothing was copied ({len(problems)} difference(s)):\n"
            + "\n".join(f"  - {p}" for p in problems)
        )
    with torch.no_grad():
        for _, t, theirs in pairs:
            t.copy_(theirs.to(device=t.device, dtype=t.dtype))
    return [name for name, _, _ in pairs]


@contextlib.contextmanager
def routers_of(into: nn.Module, source: nn.Module, facts: RouterFacts, names=("post", "base"), shared_gates=False):
    """``into`` runs with ``source``'s routers inside the block (``put_routers``), and with its own again after,
    bit for bit: its router tensors are kept aside (copies of the routers alone) and copied back on exit."""
    kept = [
        (t, t.detach().clone())
        for layer in find_moe_layers(into, facts)
        for t in _tensors(into, layer, facts, shared_gates).values()
        if t is not None
    ]
    put_routers(into, source, facts, names, shared_gates)
    try:
        yield into
    finally:
        with torch.no_grad():
            for t, saved in kept:
                t.copy_(saved)
