"""The base's routing of one step, as one router's loss term reads it: ``base_into`` puts the rows of MoE layer
``pos`` (the online base's logits and, for ``hidden-kd``, its router inputs; or the stored routes) into the
``RouterState``, after checking the step carries them and that they are this batch's.

Shape legend: T = the step's tokens, E = experts, H = hidden size, L = MoE layers.
"""

from __future__ import annotations

import torch

from rpb.anchors.methods import Method, RouterState, take_stored


def base_into(
    state: RouterState, base, pos: int, method: Method, routes_loss: str | None, router: str, logits_TE: torch.Tensor
) -> None:
    """MoE layer ``pos``'s part of ``base`` (``rpb.teacher.BaseRouting``, or None) into ``state``, on the device of
    ``logits_TE`` (the training forward's router logits at ``router``)."""
    if base is None:
        raise RuntimeError(
            f"{method.name}: this step carries no base routing; the trainer runs the base before the "
            "training forward (rpb's AnchorTrainer and TRL trainers do). In a loop of your own: "
            "ctx.base = handle.base_routing(batch, sample_index_BT) inside handle.step(...)"
        )
    if base.num_tokens != logits_TE.shape[0]:
        raise RuntimeError(
            f"{method.name}: the base's routing covers {base.num_tokens} tokens, router {router} "
            f"saw {logits_TE.shape[0]}: it was made for another batch"
        )
    device = logits_TE.device
    if "base_hidden" in method.loss.reads:
        if base.hidden_LTH is None:
            raise RuntimeError(
                f"{method.name}: the base's routing of this step carries no hidden states; the online "
                "base gives them (handle.base_routing asks for them), stored routes cannot"
            )
        state.base_hidden_TH = base.hidden_LTH[pos].to(device)
    if base.logits_LTE is not None:
        state.routing_logits_TE = base.logits_LTE[pos].to(device)
    else:
        take_stored(state, base, pos, device, routes_loss)
