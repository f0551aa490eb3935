"""Routes as they travel: one rollout's own, and a padded batch's.

Shape legend: B = rollouts, S = positions of a padded batch (prompt then completion), L = MoE layers, K = top-k,
N = one rollout's tokens (prompt and completion, no padding).

* ``routes_NLK`` (one rollout): the top-k expert ids each of its tokens was routed to, in each MoE layer, for
  every token but the last (``N - 1`` rows): generation never forwards its last token, and neither do the
  engines (vLLM's ``routed_experts`` and SGLang's are ``[seq_len - 1, layers, top_k]``). The last token's route
  would change no log-probability the loss reads: the log-probability of token t is read at position t - 1.
* ``routes_BSLK`` (a batch): the same, placed where each token sits in the batch's padded layout (the prompt
  left-padded to P, the completion right-padded to C, as TRL lays out ``cat(prompt_ids, completion_ids)``); -1
  where a position has no route (padding, each rollout's last token). A position with a route is replayed; one
  without is routed freely. Stored in the narrowest integer type that holds the ids (``route_dtype``).
"""

from __future__ import annotations

import torch

from rpb.errors import ArgumentError

#: the id of "no route here" in a padded batch
NO_ROUTE = -1


def route_dtype(num_experts: int) -> torch.dtype:
    """The narrowest integer type holding every expert id and -1: a batch's routes are ``B x S x L x K`` ids
    (256 rollouts of 8k tokens, 48 layers, top-8: 1.6 GB in int16, four times that in int64), as engines keep
    them narrow too (vLLM: uint8 / uint16)."""
    return torch.int16 if num_experts <= torch.iinfo(torch.int16).max else torch.int32


def rollout_routes(routes_BSLK: torch.Tensor, keep_BS: torch.Tensor) -> list[torch.Tensor]:
    """Each rollout's own ``routes_NLK``, read off a padded batch: the routes at the positions ``keep_BS`` marks
    (its prompt and completion tokens), the last of them dropped. ``routes_BSLK`` may be one position shorter
    than ``keep_BS`` (generation's recording: the last position is never forwarded)."""
    B, S = keep_BS.shape
    if routes_BSLK.shape[1] == S - 1:
        pad = routes_BSLK.new_full((B, 1, *routes_BSLK.shape[2:]), NO_ROUTE)
        routes_BSLK = torch.cat([routes_BSLK, pad], dim=1)
    if routes_BSLK.shape[:2] != (B, S):
        raise ArgumentError(f"routes of shape {tuple(routes_BSLK.shape)} do not fit a batch of {B} x {S} tokens")
    out = []
    for b in range(B):
        rows_NLK = routes_BSLK[b][keep_BS[b].bool()]
        out.append(rows_NLK[:-1].clone())
    return out


def batch_routes(
    rollouts: list[torch.Tensor], prompt_mask_BP: torch.Tensor, completion_mask_BC: torch.Tensor
) -> torch.Tensor:
    """``routes_BSLK`` for the padded batch ``cat(prompt, completion)``: rollout b's ``routes_NLK`` placed on its
    tokens (``prompt_mask_BP`` left-padded, ``completion_mask_BC`` right-padded), -1 elsewhere.

    Rollout b must have exactly one route fewer than its tokens; any other count is refused, naming it."""
    B, P = prompt_mask_BP.shape
    C = completion_mask_BC.shape[1]
    if len(rollouts) != B:
        raise ArgumentError(f"{len(rollouts)} rollouts' routes for a batch of {B}")
    L, K = rollouts[0].shape[1:] if rollouts else (0, 0)
    top = max((int(r.max()) for r in rollouts if r.numel()), default=0)
    out_BSLK = torch.full((B, P + C, L, K), NO_ROUTE, dtype=route_dtype(top + 1))
    keep_BS = torch.cat([prompt_mask_BP, completion_mask_BC], dim=1).bool().cpu()
    problems = []
    for b, routes_NLK in enumerate(rollouts):
        positions = keep_BS[b].nonzero().squeeze(1)
        if routes_NLK.shape[0] != positions.numel() - 1 or tuple(routes_NLK.shape[1:]) != (L, K):
            problems.append(
                f"rollout {b}: {routes_NLK.shape[0]} routes of {tuple(routes_NLK.shape[1:])} for its "
                f"{positions.numel()} tokens (expected {positions.numel() - 1} of {(L, K)}: one per token but the "
                "last)"
            )
            continue
        out_BSLK[b, positions[:-1]] = routes_NLK.to(out_BSLK.dtype).cpu()
    if problems:
        raise ArgumentError("routes that do not fit their rollouts:\n  " + "\n  ".join(problems))
    return out_BSLK.to(prompt_mask_BP.device)


def routed_positions(routes_BSLK: torch.Tensor) -> torch.Tensor:
    """``has_BS``: the positions that carry a route (every layer's ids given)."""
    return (routes_BSLK >= 0).all(dim=-1).all(dim=-1)
