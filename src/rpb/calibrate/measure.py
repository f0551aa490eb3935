"""Pure counting for ``rpb calibrate``: how far a prior bias moves the base's own expert choice.

Shape legend: T tokens, K top-k, E experts, G expert groups, L MoE layers, R sampled rows,
S subsets of content tokens (0 = Q, 1 = A; "both" is their sum), B bootstrap resamples.

Every figure is a ratio of sums over the sampled rows (changed tokens / content tokens, summed
overlaps / content tokens), kept per row, subset and layer so that a bootstrap over rows can put a
confidence interval on it: resampling rows with replacement is a multinomial weight per row, and
each resample's estimate is a weighted ratio of the same sums.
"""

from __future__ import annotations

import torch

from rpb.prior import NUM_SPANS, SPAN_NAMES

SUBSETS = ("both", *SPAN_NAMES)
BOOTSTRAP_RESAMPLES = 1000


def same_sets(a_TK: torch.Tensor, b_TK: torch.Tensor) -> torch.Tensor:
    """True where two selections hold the same experts, as unordered sets."""
    return (a_TK.sort(dim=-1).values == b_TK.sort(dim=-1).values).all(dim=-1)


def set_overlap(a_TK: torch.Tensor, b_TK: torch.Tensor, num_experts: int) -> torch.Tensor:
    """|a ∩ b| per token (a count, not yet divided by k)."""
    a_TE = torch.zeros(a_TK.shape[0], num_experts, dtype=torch.bool, device=a_TK.device).scatter_(1, a_TK, True)
    b_TE = torch.zeros_like(a_TE).scatter_(1, b_TK, True)
    return (a_TE & b_TE).sum(dim=-1)


class RowSums:
    """Per-row sums of one statistic: ``sums[q, r, s, l]`` for ``q`` quantities (betas, say)."""

    def __init__(self, quantities: int, rows: int, layers: int):
        self.sums_QRSL = torch.zeros(quantities, rows, NUM_SPANS, layers, dtype=torch.float64)

    def add(self, q: int, layer: int, row_T: torch.Tensor, span_T: torch.Tensor, values_T: torch.Tensor) -> None:
        """Add ``values_T`` of content tokens (``row_T`` in [0, R), ``span_T`` in {0, 1}) to their rows."""
        rows = self.sums_QRSL.shape[1]
        flat = torch.zeros(rows * NUM_SPANS, dtype=torch.float64)
        flat.index_add_(0, (row_T * NUM_SPANS + span_T).cpu(), values_T.to(torch.float64).cpu())
        self.sums_QRSL[q, :, :, layer] += flat.view(rows, NUM_SPANS)


def subset_sums(sums_QRSL: torch.Tensor) -> torch.Tensor:
    """``[Q, R, 3, L]``: the subsets both, Q, A."""
    return torch.cat([sums_QRSL.sum(dim=2, keepdim=True), sums_QRSL], dim=2)


def ratio_with_ci(
    numerator_QRSL: torch.Tensor, denominator_RSL: torch.Tensor, seed: int, resamples: int = BOOTSTRAP_RESAMPLES
) -> dict[str, torch.Tensor]:
    """The ratio of row sums, per quantity, subset (both, Q, A) and layer, with 95% bootstrap intervals.

    ``layers`` ``[Q, 3, L]``: sum over rows of the numerator over the same of the denominator;
    ``mean`` ``[Q, 3]``: its mean over layers. ``*_ci`` add a last axis (low, high): the 2.5th and
    97.5th percentiles over row-bootstrap resamples (seeded; a row drawn twice counts twice).
    """
    num_QRXL = subset_sums(numerator_QRSL.double())
    den_RXL = subset_sums(denominator_RSL.double()[None])[0]
    rows = den_RXL.shape[0]
    layers = num_QRXL.sum(dim=1) / den_RXL.sum(dim=0)
    gen = torch.Generator().manual_seed(seed)
    draws_BR = torch.randint(rows, (resamples, rows), generator=gen)
    weights_BR = torch.zeros(resamples, rows, dtype=torch.float64).scatter_add_(
        1, draws_BR, torch.ones(resamples, rows, dtype=torch.float64)
    )
    boot_num_BQXL = torch.einsum("br,qrxl->bqxl", weights_BR, num_QRXL)
    boot_BQXL = boot_num_BQXL / torch.einsum("br,rxl->bxl", weights_BR, den_RXL)[:, None]

    def interval(t: torch.Tensor) -> torch.Tensor:
        return torch.stack([torch.nanquantile(t, 0.025, dim=0), torch.nanquantile(t, 0.975, dim=0)], dim=-1)

    return {
        "layers": layers,
        "layers_ci": interval(boot_BQXL),
        "mean": layers.mean(dim=-1),
        "mean_ci": interval(boot_BQXL.mean(dim=-1)),
    }
