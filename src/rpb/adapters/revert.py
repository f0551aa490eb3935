"""One model's routers put into another: the base's back into a post-trained model (``rpb retention
--revert-routers``), or the other way round.

What is put is what decides the routing, as the family's facts name it (``rpb.adapters.fingerprint.router_tensors``):
the router's weight, its bias where the family has one (gpt-oss) and the expert-correction bias, a buffer, the
router's or (MiniMax-M2) its MoE block's. Nothing else is touched. Each tensor is copied in place, in the
receiving model's dtype, so "bit for bit" means the source's values in that dtype. A PEFT-wrapped router must be
merged first (the wrapper's factors would still move it).
"""

from __future__ import annotations

import torch
from torch import nn

from rpb.adapters.fingerprint import router_tensors
from rpb.adapters.hf import RouterFacts, find_moe_layers
from rpb.errors import ArgumentError


def put_routers(into: nn.Module, source: nn.Module, facts: RouterFacts, names: tuple[str, str] = ("post", "base")):
    """Copy every MoE router of ``source`` into ``into`` (both of ``facts``' family), in place; returns the names
    of the tensors copied (``<router module>.<tensor>``). Refused before anything is copied, every difference
    named: other MoE layers, a tensor one of them lacks, other shapes. ``names``: what the messages call the
    two models."""
    dst, src = find_moe_layers(into, facts), find_moe_layers(source, facts)
    problems = []
    if [m.layer_index for m in dst] != [m.layer_index for m in src]:
        problems.append(
            f"MoE layers: the {names[0]} model has {[m.layer_index for m in dst]}, the {names[1]} model "
            f"{[m.layer_index for m in src]}"
        )
    pairs = []
    for d, s in zip(dst, src, strict=False):
        theirs, ours = router_tensors(s, facts), router_tensors(d, facts)
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
                pairs.append((f"{d.name}.{name}", t, theirs[name]))
    if problems:
        raise ArgumentError(
            f"the routers of the two models differ, nothing was copied ({len(problems)} difference(s)):\n"
            + "\n".join(f"  - {p}" for p in problems)
        )
    with torch.no_grad():
        for _, t, theirs in pairs:
            t.copy_(theirs.to(device=t.device, dtype=t.dtype))
    return [name for name, _, _ in pairs]
