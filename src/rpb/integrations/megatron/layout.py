"""Pure token layout for Megatron-Core routers: which (sample, span) each router row belongs to.

Shape legend for the suffixes on tensor names:
  B = micro-batch rows, S = sequence positions of the micro-batch (the full sequence,
  before any sequence-parallel split), s = the positions one TP rank holds, T = router rows
  (tokens as the router sees them), Q = packed sequences of a THD micro-batch.

Megatron's ``TopKRouter.routing`` receives logits ``[s, b, E]`` and flattens them with
``view(-1, E)``, so router row ``t = position * b + batch_index``: position-major, the
transpose of the ``[B, S]`` batch the data loader yields. Under sequence parallelism the
router of TP rank ``r`` holds positions ``[r * S / tp, (r + 1) * S / tp)`` of every row (the
embedding scatters the sequence dimension over the TP group before the first layer). A
packed THD micro-batch is one row ``[1, S]`` whose sequences sit at ``cu_seqlens``; it
follows the same rule. Context parallelism (each sequence cut into 2 * cp chunks) is
refused by the router integration, so nothing here models it.

Nothing here imports megatron.
"""

from __future__ import annotations

import torch

from rpb.prior import STRUCTURAL
from rpb.prior.artifact import ROUTED_ALL_POSITIONS
from rpb.teacher.routing import BaseRouting

#: Routed-position rules: ``ROUTED_ALL_POSITIONS`` is the collector's (every position of the
#: right-truncated sequence, recorded in the prior's metadata). Megatron's stock SFT datasets
#: feed ``input_ids[:-1]`` (labels are the same ids shifted by one), so the last position of
#: each sequence never reaches a router:
ROUTED_ALL_BUT_LAST = "all-but-last-position-of-truncated-sequence"


def router_rows(ids_BS: torch.Tensor, tp_rank: int = 0, tp_size: int = 1, sequence_parallel: bool = False):
    """``ids_T``: a per-token ``[B, S]`` tensor laid out as the router of this TP rank sees its rows."""
    if ids_BS.dim() != 2:
        raise ValueError(f"expected a [micro_batch, seq_len] tensor, got shape {tuple(ids_BS.shape)}")
    if sequence_parallel and tp_size > 1:
        S = ids_BS.shape[1]
        if S % tp_size:
            raise ValueError(
                f"sequence length {S} is not divisible by the tensor-parallel size {tp_size}; "
                "Megatron's sequence parallelism needs it to be (pad the micro-batch to a multiple of tp)"
            )
        shard = S // tp_size
        ids_BS = ids_BS[:, tp_rank * shard : (tp_rank + 1) * shard]
    # [B, s] -> [s, B] -> rows position * B + batch_index, as routing()'s view(-1, E) reads [s, b, E]
    return ids_BS.transpose(0, 1).reshape(-1)


def pack_thd(
    sample_Q: list[int], spans_Q: list[torch.Tensor], cu_seqlens: torch.Tensor, total_len: int | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(sample_BS, span_BS)`` with B = 1 for a packed (THD) micro-batch.

    Sequence ``q`` occupies positions ``cu_seqlens[q] : cu_seqlens[q + 1]`` (pass the padded
    ``cu_seqlens`` when the packer pads each sequence); its first ``len(spans_Q[q])`` positions
    are its tokens, the rest of its slot and everything after the last slot are padding
    (sample -1, span STRUCTURAL), so no bias reaches them.
    """
    cu = [int(c) for c in torch.as_tensor(cu_seqlens).reshape(-1).tolist()]
    if len(cu) != len(sample_Q) + 1 or len(spans_Q) != len(sample_Q):
        raise ValueError(
            f"{len(sample_Q)} sequences need {len(sample_Q) + 1} cu_seqlens entries and as many span rows; "
            f"got {len(cu)} and {len(spans_Q)}"
        )
    S = cu[-1] if total_len is None else int(total_len)
    sample_BS = torch.full((1, S), -1, dtype=torch.long)
    span_BS = torch.full((1, S), STRUCTURAL, dtype=torch.long)
    for q, (row, spans) in enumerate(zip(sample_Q, spans_Q, strict=True)):
        start, end = cu[q], cu[q + 1]
        n = len(spans)
        if n > end - start:
            raise ValueError(f"sequence {q} has {n} tokens but its cu_seqlens slot holds {end - start}")
        sample_BS[0, start : start + n] = int(row)
        span_BS[0, start : start + n] = torch.as_tensor(spans, dtype=torch.long)
    return sample_BS, span_BS


def routed_position_problems(prior_rule: str | None, run_rule: str, rows: list[tuple[int, list[int]]]) -> list[str]:
    """Why a prior collected under ``prior_rule`` cannot drive a run that routes under ``run_rule``.

    ``rows`` are ``(sample index, span ids of the truncated sequence the run feeds)``. Equal
    rules agree. A prior over every position used by a run that drops each sequence's last
    position is reconciled exactly when that position never counted in the prior: a span
    mean (eq. 2) only sums Q and A tokens, so a structural last token (the turn end of a chat
    template) leaves every prior row unchanged. A row that ends on a Q/A token (a row cut by
    truncation, typically) would train against a prior that counted a token the run never
    routes: that is a mismatch, as is any other pairing of rules.
    """
    if prior_rule == run_rule:
        return []
    if prior_rule == ROUTED_ALL_POSITIONS and run_rule == ROUTED_ALL_BUT_LAST:
        content_last = [row for row, spans in rows if spans and spans[-1] != STRUCTURAL]
        if not content_last:
            return []
        shown = ", ".join(str(r) for r in content_last[:10]) + (" ..." if len(content_last) > 10 else "")
        return [
            f"routed_positions: the prior routed every position but this run never routes the last one, and "
            f"{len(content_last)} row(s) end on a Q/A token that the prior counted (rows {shown}); feed every "
            f"position to the model (rpb's Megatron dataset does) or end each row with a structural token"
        ]
    return [f"routed_positions: the prior was collected under {prior_rule!r}, this run routes {run_rule!r}"]


def stored_rows(ids_BSLK, probs_BSLK, extra_BSLJ, tp_rank: int, tp_size: int) -> BaseRouting:
    """A micro-batch's stored routes (``[B, S, L, K]`` ids, probabilities or None, a ``--top-m`` file's extra experts
    or None) laid out as the routers' rows, ``[L, T, K]`` each (``router_rows``; ``tp_size`` 1: the whole
    micro-batch's rows, as under sequence parallelism the term reads them gathered)."""

    def rows(x_BSLK):  # any width K
        K = x_BSLK.shape[-1]
        per = [
            torch.stack([router_rows(x_BSLK[:, :, pos, k], tp_rank, tp_size, False) for k in range(K)], -1)
            for pos in range(x_BSLK.shape[2])
        ]
        return torch.stack(per)

    probs = None if probs_BSLK is None else rows(probs_BSLK.float())
    base = BaseRouting(ids_LTK=rows(ids_BSLK.long()), probs_LTK=probs)
    if extra_BSLJ is not None:
        base.extra_ids_LTJ, base.extra_probs_LTJ = rows(extra_BSLJ[0].long()), rows(extra_BSLJ[1].float())
    return base
