"""``routing-kd`` in rpb's GRPO: the base's routing of each rollout, and what cannot give it, refused by name.

Shape legend: B = completions of a batch, P / C = its padded prompt / completion lengths, S = P + C,
L = MoE layers, E = routed experts.

Where q (the base's router distribution per completion token and MoE layer) comes from:

* **``beta > 0``: the reference model's own forward**, which TRL runs anyway for its KL term (``ref_model``, or the
  policy with its adapters disabled under PEFT). Hooks of this module read its routers' logits at the completion
  positions, chunk by chunk as TRL forwards them; the ``[B, C, L, E]`` float32 tensor travels in the batch dict as
  ``rpb_base_routing``, through TRL's shuffling and splitting with the rows it belongs to, and the training step
  reads its micro-batch's rows. No forward is added; q is the RL start's routing. Its memory is said once.
* **``beta = 0``** (TRL's default): no reference forward runs, so the anchor's online base runs its own no-grad
  forward on each micro-batch (``rpb.teacher``): under PEFT the policy with its adapters disabled (set up here);
  under full fine-tuning a frozen copy the caller gives (``anchor.teacher = rpb.teacher.online_base(...)``),
  else refused.

Refused: ``output-kd`` (TRL's ``beta`` is that term), ``anchor.base=routes`` (generated completions have no stored
routes), ``sync_ref_model=True`` (the reference would move, and q with it).
"""

from __future__ import annotations

import contextlib

import torch

from rpb.adapters import find_moe_layers
from rpb.observe.hooks import on_model_inputs, on_router_calls
from rpb.teacher import BaseRouting
from rpb.teacher.online import is_peft

#: the batch dict's key of the reference model's routing at the completion positions
BASE_ROUTING = "rpb_base_routing"


def teacher_problems(args, anchor, model, peft_config=None) -> list[str]:
    """What of the anchor's teacher GRPO cannot serve (empty: all is well)."""
    if anchor is None or anchor.method.teacher is None:
        return []
    name = anchor.method.name
    if anchor.method.teacher == "output":
        return [
            f"anchor.method={name} in GRPO: TRL's beta is that term (the KL to the reference model's next-token "
            "distribution over the completion tokens); set beta instead"
        ]
    out = []
    if anchor.method.loss is not None and anchor.method.loss.reads & {"detached_logits", "hidden"}:
        out.append(
            f"anchor.method={name} in GRPO: a control of why routing-kd holds in supervised fine-tuning "
            "(docs/methods.md), not built here; use routing-kd"
        )
    if anchor.config.base == "routes":
        out.append(
            f"anchor.method={name} with anchor.base=routes in GRPO: a route file holds the routes of stored rows, "
            "and the completions are generated; use anchor.base=online"
        )
    if getattr(args, "sync_ref_model", False):
        out.append(
            f"anchor.method={name} with sync_ref_model=True: the reference model moves towards the policy, and the "
            "base routing routing-kd holds to would move with it; set sync_ref_model=False"
        )
    peft = peft_config is not None or is_peft(model)
    if args.beta == 0.0 and not peft and anchor.teacher is None:
        out.append(
            f"anchor.method={name} with beta=0 under full fine-tuning: no reference forward runs, so the base must "
            "be given: anchor.teacher = rpb.teacher.online_base(model, anchor.facts, model_id=<the checkpoint>, "
            "dtype=None, outputs=False), or set beta > 0 to read the reference model's routing"
        )
    return out


class BaseRoutingCapture:
    """The routers' logits at the completion positions of every forward inside ``reading(model, C)``, chunk by
    chunk; ``routing_BCLE()`` the batch's, in row order."""

    def __init__(self):
        self._chunks: dict[int, list[torch.Tensor]] = {}

    @contextlib.contextmanager
    def reading(self, model, facts, completion_len: int):
        layers = find_moe_layers(model, facts)  # under PEFT's disabled adapters: the routers that run then
        self._chunks = {pos: [] for pos in range(len(layers))}
        shape: dict = {}

        def on_inputs(args, kwargs):
            ids = kwargs.get("input_ids", args[0] if args else None)
            shape["BS"] = tuple(ids.shape)

        def on_call(call):
            logits_TE, _, _ = call.read()
            B, S = shape["BS"]
            chunk = logits_TE.detach().float().reshape(B, S, -1)[:, S - completion_len :]
            self._chunks[call.pos].append(chunk.cpu())

        with on_model_inputs(model, on_inputs), on_router_calls(layers, on_call):
            yield

    def routing_BCLE(self) -> torch.Tensor:
        per_layer = [torch.cat(self._chunks[pos]) for pos in sorted(self._chunks)]
        self._chunks = {}
        return torch.stack(per_layer, dim=2)


def step_routing(base_BCLE: torch.Tensor, prompt_len: int) -> BaseRouting:
    """The micro-batch's base routing as the anchor reads it: ``[L, B * S, E]`` logits, the completion positions the
    reference's, the prompt positions 0 (their tokens weigh 0 in GRPO's anchor terms)."""
    B, C, L, E = base_BCLE.shape
    full_LBSE = torch.zeros(L, B, prompt_len + C, E, dtype=torch.float32, device=base_BCLE.device)
    full_LBSE[:, :, prompt_len:] = base_BCLE.permute(2, 0, 1, 3)
    known_BS = torch.zeros(B, prompt_len + C, dtype=torch.bool, device=base_BCLE.device)
    known_BS[:, prompt_len:] = True
    return BaseRouting(logits_LTE=list(full_LBSE.reshape(L, B * (prompt_len + C), E)), known_T=known_BS.reshape(-1))


def adapters_disabled(model) -> bool:
    """Whether a PEFT model's forward runs without its trained adapters now (TRL's reference forward under PEFT:
    the adapters disabled, or the initial copy loaded as adapter ``ref``)."""
    layers = [m for m in model.modules() if hasattr(m, "merged_adapters")]
    if not layers:
        return False
    return any(getattr(m, "disable_adapters", False) for m in layers) or any(
        getattr(m, "active_adapters", None) == ["ref"] for m in layers
    )
