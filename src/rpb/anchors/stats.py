"""Per-layer routing statistics of a training window: counted per rank, summed across ranks, named.

The anchor's hook adds every training step's counts (``LayerStats.add``); at each log the window's
counts are summed over the data-parallel ranks (``reduce_across_ranks``: a rank sees only its own
tokens) and turned into named figures (``routing_metrics``):

  moe/layer_{i}/load_min, load_max    least and most used expert's share of the dispatched
                                      assignments (after the bias: the experts that actually ran)
  moe/layer_{i}/load_cv               coefficient of variation of the experts' loads
  moe/layer_{i}/dead_experts          experts no token was dispatched to in the window
  moe/layer_{i}/utilization_entropy_bits
  moe/layer_{i}/bias_changed_fraction content tokens whose expert set the prior changed
  moe/layer_{i}/anchor_loss           the layer's loss term, coefficient applied (loss methods)
  moe/layer_{i}/base_topk_overlap_current_hidden
                                      |S ∩ S_base| / k: the current router's own top-k against the
                                      frozen base router's, on the same (current) hidden states
                                      (methods that keep a base router)
  moe/layer_{i}/routes_hinge_active   the share of tokens where routing-kd's ids-alone hinge is active:
                                      the model's rule no longer returns the base's stored set
  moe/mean/...                        the same, averaged over MoE layers

``i`` is the decoder-layer index. Shape legend: E experts.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from rpb.retention.metrics import entropy_bits

_SCALARS = ("tokens", "content", "changed", "term_sum", "term_steps", "overlap", "overlap_tokens")
_SCALARS += ("hinge_active", "hinge_tokens")


@dataclass
class LayerStats:
    """One MoE layer's counts over a window of training steps."""

    tokens: int = 0  # non-padding tokens (the load's denominator)
    content: int = 0  # Q / A tokens: the only ones a prior can move
    changed: int = 0  # content tokens whose selected set differs from the native one
    load_E: torch.Tensor | None = None  # assignments dispatched to each expert
    term_sum: float = 0.0  # the layer's loss term (coefficient applied), summed over steps
    term_steps: int = 0
    overlap: int = 0  # sum over tokens of |S_current ∩ S_base|
    overlap_tokens: int = 0
    hinge_active: int = 0  # tokens where routing-kd's ids-alone hinge is positive (the base's set being lost)
    hinge_tokens: int = 0
    top_k: int = 1

    @property
    def changed_fraction(self) -> float:
        """Of the tokens the bias can reach (content), the fraction whose expert set it changed."""
        return self.changed / max(self.content, 1)

    @property
    def utilization_entropy_bits(self) -> float:
        return float(entropy_bits(self.load_E))

    def pack(self) -> torch.Tensor:
        """The counts as one float64 vector (scalars, then the load), for summing across ranks."""
        head = torch.tensor([float(getattr(self, k)) for k in _SCALARS], dtype=torch.float64)
        return torch.cat([head, self.load_E.double()])

    @classmethod
    def unpack(cls, v: torch.Tensor, top_k: int) -> LayerStats:
        n = len(_SCALARS)
        values = dict(zip(_SCALARS, v[:n].tolist(), strict=True))
        ints = {k: round(x) for k, x in values.items() if k != "term_sum"}
        return cls(**ints, term_sum=values["term_sum"], load_E=v[n:].float(), top_k=top_k)


def reduce_across_ranks(stats: dict[int, LayerStats]) -> dict[int, LayerStats]:
    """The window's counts summed over every rank of the default process group (as they are with one)."""
    dist = torch.distributed
    if not stats or not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() == 1:
        return stats
    keys = sorted(stats)
    flat = torch.stack([stats[k].pack() for k in keys])
    if dist.get_backend() == "nccl":
        flat = flat.cuda()
    dist.all_reduce(flat)
    flat = flat.cpu()
    return {k: LayerStats.unpack(flat[i], stats[k].top_k) for i, k in enumerate(keys)}


def _figures(s: LayerStats, loss: bool, base: bool, prior: bool) -> dict[str, float]:
    share_E = s.load_E / s.load_E.sum().clamp(min=1)
    out = {
        "load_min": float(share_E.min()),
        "load_max": float(share_E.max()),
        "load_cv": float(s.load_E.std(unbiased=False) / s.load_E.mean().clamp(min=1e-12)),
        "dead_experts": int((s.load_E == 0).sum()),
        "utilization_entropy_bits": s.utilization_entropy_bits,
    }
    if prior:  # a method that reads no prior changes no expert set: its 0 would say nothing
        out["bias_changed_fraction"] = s.changed_fraction
    if loss:
        out["anchor_loss"] = s.term_sum / max(s.term_steps, 1)
    if base:
        out["base_topk_overlap_current_hidden"] = s.overlap / max(s.overlap_tokens * s.top_k, 1)
    if s.hinge_tokens:
        out["routes_hinge_active"] = s.hinge_active / s.hinge_tokens
    return out


def routing_metrics(
    stats: dict[int, LayerStats],
    layer_index: dict[int, int],
    *,
    loss: bool,
    base: bool,
    prior: bool,
    digits: int = 6,
) -> dict[str, float]:
    """``moe/layer_{i}/<figure>`` for every recorded layer and ``moe/mean/<figure>`` across them: the anchor's term
    where it has one (``loss``), the overlap with the frozen base router's sets (``base``), the share of sets the
    prior changed where it reads one (``prior``)."""
    per = {pos: _figures(s, loss, base, prior) for pos, s in sorted(stats.items()) if s.load_E is not None}
    out: dict[str, float] = {}
    for pos, figs in per.items():
        out |= {f"moe/layer_{layer_index[pos]}/{k}": round(v, digits) for k, v in figs.items()}
    if per:
        names = next(iter(per.values()))
        out |= {f"moe/mean/{k}": round(sum(f[k] for f in per.values()) / len(per), digits) for k in names}
    return out
