"""One step's base routing, as the anchor's hook reads it (a base forward captures it with
``rpb.observe.capture.RouterCapture``).

Shape legend: T = the step's tokens (flattened, as the routers see them), L = MoE layers, E = experts, K = top-k,
B = rows, V = vocabulary.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass
class BaseRouting:
    """The base's routing of one step's tokens. Online: ``logits_LTE``, each MoE layer's router logits on the base's
    own hidden states (float32). Stored: ``ids_LTK``, the base's top-k per token, and ``probs_LTK`` its router
    probabilities there (None: the route file holds ids alone); where the file stores more experts than the top-k
    (``rpb routes --top-m``), ``extra_ids_LTJ`` and ``extra_probs_LTJ``, the next ones by probability.
    ``output_BTV``: the base's next-token logits (``output-kd``; None when the forward stopped at the last
    router)."""

    logits_LTE: list[torch.Tensor] | None = None
    ids_LTK: torch.Tensor | None = None
    probs_LTK: torch.Tensor | None = None
    output_BTV: torch.Tensor | None = None
    extra_ids_LTJ: torch.Tensor | None = None
    extra_probs_LTJ: torch.Tensor | None = None
    #: each MoE router's input in the base's forward, float32 (``hidden-kd``; None unless asked for)
    hidden_LTH: list[torch.Tensor] | None = None
    #: the tokens whose base routing is known (None: every one; GRPO's reference routing: the completions')
    known_T: torch.Tensor | None = None

    @property
    def num_layers(self) -> int:
        return len(self.logits_LTE) if self.logits_LTE is not None else int(self.ids_LTK.shape[0])

    @property
    def num_tokens(self) -> int:
        return int(self.logits_LTE[0].shape[0] if self.logits_LTE is not None else self.ids_LTK.shape[1])

    def nbytes(self) -> int:
        tensors = [*(self.logits_LTE or ()), *(self.hidden_LTH or ()), self.ids_LTK, self.probs_LTK, self.output_BTV]
        tensors.append(self.extra_ids_LTJ)
        tensors.append(self.extra_probs_LTJ)
        return sum(t.numel() * t.element_size() for t in tensors if t is not None)
