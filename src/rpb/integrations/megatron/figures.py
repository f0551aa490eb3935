"""The Megatron path's routing figures, with the HF path's names (``rpb.anchors.stats``).

Per micro-batch the handle counts, per router, the content tokens whose expert set the prior
changed and -- for methods that keep a base router -- the current router's top-k overlap with the
base router on the current router input. ``report()`` hands them to Bridge as ``[numerator,
denominator]`` pairs, which Bridge sums over micro-batches and data-parallel ranks before dividing;
under sequence parallelism the counts are first summed over the TP group (each rank routes its own
rows). Load, dead experts and utilization entropy are not ratios of sums, so Bridge's reduction
cannot carry them: they are logged on the HF path only.
"""

from __future__ import annotations

import torch
from torch import nn


class RoutingFigures:
    """Mixed into ``MegatronAnchorHandle``, which provides the routers, the context, the method, the prior,
    the config and ``_native_topk`` (Megatron's own selection)."""

    @torch.no_grad()
    def _record_counts(self, r, logits, hidden, padding_mask, ctx, chosen_TK, native_TK) -> None:
        """Counts of router ``r`` for this micro-batch (the first call's): content tokens, those whose set
        the prior changed, and -- with a base router -- the current router's top-k overlap with the base's
        on the current router input."""
        if ("counts", r.pos) in ctx.cache:
            return
        logits_TE = logits.detach().reshape(-1, logits.shape[-1])
        valid_T = ctx.valid_T.to(logits_TE.device)
        if padding_mask is not None:
            valid_T = valid_T & ~padding_mask.reshape(-1).to(valid_T.device).bool()
        content_T = valid_T & (ctx.span_T.to(valid_T.device) >= 0)
        changed = 0.0
        if chosen_TK is not None:
            differs_T = (chosen_TK.sort(-1).values != native_TK.sort(-1).values).any(-1)
            changed = float((differs_T & content_T).sum())
        overlap = 0.0
        if r.base_weight_EH is not None and hidden is not None:
            native_TK = self._native_topk(r.module, logits_TE) if native_TK is None else native_TK
            base_weight_EH, base_bias_E = r.base_on(logits_TE.device)
            base_TE = nn.functional.linear(hidden.reshape(-1, hidden.shape[-1]).float(), base_weight_EH, base_bias_E)
            base_TK = self._native_topk(r.module, base_TE)
            overlap = float((native_TK[:, :, None] == base_TK[:, None, :]).any(-1).sum(-1)[valid_T].sum())
        counts = [changed, float(content_T.sum()), overlap, float(valid_T.sum()) * r.module.topk]
        ctx.cache[("counts", r.pos)] = torch.tensor(counts, dtype=torch.float64)

    def report(self) -> dict[str, torch.Tensor]:
        """This micro-batch's figures as ``[numerator, denominator]`` pairs, which Bridge sums over
        micro-batches and data-parallel ranks before dividing: ``moe/layer_{i}/bias_changed_fraction``
        (prior methods), ``base_topk_overlap_current_hidden`` (methods with a base router),
        ``anchor_loss`` (loss methods) and ``routes_hinge_active`` (routing-kd's ids-alone hinge), and
        ``moe/mean/...`` over layers. Load, dead experts and
        entropy are not ratios of sums, so Bridge's reduction cannot carry them; they are HF-path only."""
        ctx = self._context
        if ctx is None:
            return {}
        rows = {r.pos: ctx.cache[("counts", r.pos)] for r in self.routers if ("counts", r.pos) in ctx.cache}
        if not rows:
            return {}
        counts_RC = torch.stack([rows[p] for p in sorted(rows)])
        if self._split:  # each TP rank counted its own rows
            counts_RC = self._sum_over_tp(counts_RC)
        names = {r.pos: f"moe/layer_{r.hf_layer_index}" for r in self.routers}
        out: dict[str, torch.Tensor] = {}
        figures = []
        if self.prior is not None:
            figures.append(("bias_changed_fraction", 0, 1))
        if self.method.needs_base_router:
            figures.append(("base_topk_overlap_current_hidden", 2, 3))
        for figure, num, den in figures:
            for i, pos in enumerate(sorted(rows)):
                out[f"{names[pos]}/{figure}"] = counts_RC[i, [num, den]].float()
            # every layer sees the same tokens: the pooled ratio is the mean of the layers' ratios
            out[f"moe/mean/{figure}"] = counts_RC[:, [num, den]].sum(0).float()
        if self.method.loss is not None:
            coef = self.config.coefficient()
            terms = [(pos, ctx.cache[("term", pos)]) for pos in sorted(rows) if ("term", pos) in ctx.cache]
            for pos, term in terms:
                whole = coef * term.detach().float() * self.loss_shares
                out[f"{names[pos]}/anchor_loss"] = torch.stack([whole, torch.ones_like(whole)])
            if terms:
                mean = torch.stack([out[f"{names[p]}/anchor_loss"][0] for p, _ in terms]).mean()
                out["moe/mean/anchor_loss"] = torch.stack([mean, torch.ones_like(mean)])
        # the ids-alone hinge's active rows: counted on the whole micro-batch's rows (gathered under sequence
        # parallelism), so not summed over the TP group
        hinge = {pos: ctx.cache[("hinge", pos)] for pos in sorted(rows) if ("hinge", pos) in ctx.cache}
        for pos, pair in hinge.items():
            out[f"{names[pos]}/routes_hinge_active"] = pair.float()
        if hinge:
            out["moe/mean/routes_hinge_active"] = torch.stack(list(hinge.values())).sum(0).float()
        return out

    def _sum_over_tp(self, x: torch.Tensor) -> torch.Tensor:
        group = self.routers[0].module.tp_group
        x = x.to(self.routers[0].module.weight.device)
        torch.distributed.all_reduce(x, group=group)
        return x.cpu()
