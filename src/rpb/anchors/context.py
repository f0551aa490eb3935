"""Per-token routing context for one training step, carried with the batch (never in globals).

The routers see the batch flattened to ``B * T`` rows in row-major order, so every
per-token tensor here is flattened the same way. The context stays set from before the
forward until after backward: activation recomputation runs the forward again during
backward and must see the same bias.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch

from rpb.prior import STRUCTURAL

if TYPE_CHECKING:
    from rpb.teacher import BaseRouting


@dataclass
class TokenContext:
    """``sample_T`` (row of the data file, -1 for padding), ``span_T`` (0 Q, 1 A, -1 structural
    and padding), ``valid_T`` (not padding)."""

    sample_T: torch.Tensor
    span_T: torch.Tensor
    valid_T: torch.Tensor
    #: per-step cache owned by the anchor (bias tables, first-call flags); dropped with the context
    cache: dict = field(default_factory=dict)
    #: the weight of each token in the token terms' mean (None: valid tokens alike). GRPO gives completion
    #: tokens its own loss's weights (``rpb.integrations.trl.scaling``), normalised to sum 1
    weight_T: torch.Tensor | None = None
    #: the base's own routing of this step's tokens (``rpb.teacher``), for routing-kd and output-kd; the trainer
    #: sets it before the training forward (``AnchorHandle.base_routing``)
    base: BaseRouting | None = None

    @classmethod
    def from_batch(
        cls, sample_BT: torch.Tensor, span_BT: torch.Tensor, attention_mask_BT: torch.Tensor | None = None
    ) -> TokenContext:
        if sample_BT.shape != span_BT.shape:
            raise ValueError(f"sample index {tuple(sample_BT.shape)} and span {tuple(span_BT.shape)} differ in shape")
        valid_BT = sample_BT >= 0 if attention_mask_BT is None else attention_mask_BT.bool()
        span_BT = torch.where(valid_BT, span_BT, torch.full_like(span_BT, STRUCTURAL))
        return cls(sample_BT.reshape(-1), span_BT.reshape(-1), valid_BT.reshape(-1))

    @property
    def num_tokens(self) -> int:
        return self.sample_T.numel()

    @property
    def content_T(self) -> torch.Tensor:
        """Tokens that carry a prior (Q or A content); structural and padding tokens do not."""
        return self.span_T >= 0
