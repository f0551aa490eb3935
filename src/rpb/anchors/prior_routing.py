"""Per-step prior tables for the prior-based anchors (rpb, rpb-hard and the shuffled controls).

For one step only the (sample, span) pairs present in the batch are read from the prior
(which may be memory-mapped and far larger than memory), shuffled if the method says so,
and turned into a log-bias (soft) or a forced top-k (hard). Tokens index these small
``P``-row tables (P = distinct pairs in the batch) through ``pair_T``.

Shape legend: N samples, S spans, L MoE layers, E experts, K top-k, P pairs, T tokens.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from rpb.anchors.context import TokenContext
from rpb.anchors.controls import shuffle_prior
from rpb.prior import NUM_SPANS, log_prior_bias
from rpb.routing import select_from_prior


@dataclass
class StepTables:
    pair_T: torch.Tensor  # index into the P pair rows, valid where content_T
    content_T: torch.Tensor  # tokens that carry a prior
    bias_PLE: torch.Tensor | None = None  # soft: beta * b[x, s, l]
    topk_PLK: torch.Tensor | None = None  # hard: top-k of pi[x, s, l]


class PriorRouting:
    """Reads the prior for a step's tokens. ``pi_NSLE`` may be a memory-mapped tensor."""

    def __init__(
        self,
        pi_NSLE: torch.Tensor,
        selection: str,
        top_k: int,
        beta: float = 1.0,
        eps: float = 0.05,
        clip: float = 5.0,
        sigma_LE: torch.Tensor | None = None,
    ):
        if selection not in ("soft", "hard"):
            raise ValueError(f"selection must be 'soft' or 'hard', got {selection!r}")
        self.pi_NSLE = pi_NSLE
        self.selection = selection
        self.top_k = top_k
        self.beta = float(beta)
        self.eps, self.clip = eps, clip
        self.sigma_LE = sigma_LE

    def tables(self, ctx: TokenContext, device: torch.device) -> StepTables:
        """The step's tables, built once per context and cached in it."""
        if "prior_tables" not in ctx.cache:
            ctx.cache["prior_tables"] = self._build(ctx, device)
        return ctx.cache["prior_tables"]

    def _build(self, ctx: TokenContext, device: torch.device) -> StepTables:
        content_T = ctx.content_T
        num_rows = self.pi_NSLE.shape[0]
        bad = content_T & ((ctx.sample_T < 0) | (ctx.sample_T >= num_rows))
        if bad.any():
            raise IndexError(
                f"sample index {int(ctx.sample_T[bad][0])} is outside the prior's {num_rows} rows; "
                "the batch does not come from the data file the prior was collected on"
            )
        key_T = torch.where(content_T, ctx.sample_T * NUM_SPANS + ctx.span_T, torch.zeros_like(ctx.sample_T))
        keys_P, pair_T = torch.unique(key_T.cpu(), return_inverse=True)
        rows_PLE = self.pi_NSLE[keys_P // NUM_SPANS, keys_P % NUM_SPANS].float()
        if self.sigma_LE is not None:
            rows_PLE = shuffle_prior(rows_PLE, self.sigma_LE)
        tables = StepTables(pair_T=pair_T.to(device), content_T=content_T.to(device))
        if self.selection == "soft":
            # "bias gathered, multiplied by beta, added": beta = 0 keeps the whole path, adding exact zeros
            tables.bias_PLE = (self.beta * log_prior_bias(rows_PLE, self.eps, self.clip)).to(device)
        else:
            tables.topk_PLK = select_from_prior(rows_PLE, self.top_k).to(device)
        return tables
