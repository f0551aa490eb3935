"""Pure auxiliary-loss math for the comparison anchors (tensor in, tensor out).

Shape legend: T = tokens, E = experts, K = top-k, M = stored experts, G = expert groups, H = hidden.
``valid_T`` marks non-padding tokens; every mean below is over valid tokens only.
Each function returns one layer's term; the anchors average over MoE layers.
"""

from __future__ import annotations

import torch

from rpb.prior import router_probs
from rpb.routing import RouterSpec, kept_groups


def _masked_mean_T(values_T: torch.Tensor, valid_T: torch.Tensor) -> torch.Tensor:
    w_T = valid_T.to(values_T.dtype)
    return (values_T * w_T).sum() / w_T.sum().clamp_min(1)


def load_balancing_softmax(logits_TE: torch.Tensor, top_k: int, valid_T: torch.Tensor) -> torch.Tensor:
    """transformers' ``load_balancing_loss_func`` form for one layer: E * sum_e f_e * P_e.

    P_e is the mean softmax probability of expert e and f_e the mean over tokens of the
    number of top-k slots expert e takes (so sum_e f_e = k): a perfectly balanced router
    scores k. Megatron's form (below) divides f by k and scores 1: the two differ by a
    factor k, which is why ``anchor.lbl_coef`` is not portable between them.
    """
    probs_TE = torch.softmax(logits_TE.float(), dim=-1)
    topk_ids_TK = torch.topk(probs_TE, top_k, dim=-1).indices
    slots_TE = torch.zeros_like(probs_TE).scatter_(1, topk_ids_TK, 1.0)
    w_T1 = valid_T.to(probs_TE.dtype)[:, None]
    n = w_T1.sum().clamp_min(1)
    f_E = (slots_TE * w_T1).sum(0) / n
    P_E = (probs_TE * w_T1).sum(0) / n
    return probs_TE.shape[-1] * (f_E * P_E).sum()


def load_balancing_sigmoid(logits_TE: torch.Tensor, top_k: int, valid_T: torch.Tensor) -> torch.Tensor:
    """Megatron's ``aux_loss`` form for sigmoid routers (DeepSeek-V3 / Moonlight), one layer.

    P_e = mean over valid tokens of sigmoid(z_e) / sum_e' sigmoid(z_e'); f_e = share of
    the plain top-k of those scores (no expert bias, no groups) that goes to e, so
    sum_e f_e = 1; loss = E * sum_e f_e * P_e (1 when perfectly balanced).
    """
    probs_TE = router_probs(logits_TE, "sigmoid-normalized")
    topk_ids_TK = torch.topk(probs_TE, top_k, dim=-1).indices
    slots_TE = torch.zeros_like(probs_TE).scatter_(1, topk_ids_TK, 1.0)
    w_T1 = valid_T.to(probs_TE.dtype)[:, None]
    n = w_T1.sum().clamp_min(1)
    f_E = (slots_TE * w_T1).sum(0) / (n * top_k)
    P_E = (probs_TE * w_T1).sum(0) / n
    return probs_TE.shape[-1] * (f_E * P_E).sum()


def router_l2(weight_EH: torch.Tensor, base_weight_EH: torch.Tensor) -> torch.Tensor:
    """Eq. 5's per-layer term: ||W_l - W_l^base||_2^2 (squared Frobenius norm)."""
    return (weight_EH.float() - base_weight_EH).pow(2).sum()


def kl_to_base(
    logits_TE: torch.Tensor, base_logits_TE: torch.Tensor, valid_T: torch.Tensor, transform: str
) -> torch.Tensor:
    """Mean over valid tokens of KL(p_base || p_current), both under the prior's router transform."""
    p_base = router_probs(base_logits_TE, transform)
    log_p_base = p_base.clamp_min(1e-30).log()
    log_p = router_probs(logits_TE, transform).clamp_min(1e-30).log()
    return _masked_mean_T((p_base * (log_p_base - log_p)).sum(-1), valid_T)


def logit_l2(logits_TE: torch.Tensor, base_logits_TE: torch.Tensor, valid_T: torch.Tensor) -> torch.Tensor:
    """Mean over valid tokens of ||(z - mean_e z) - (z_base - mean_e z_base)||^2."""
    z = logits_TE.float()
    diff_TE = (z - z.mean(-1, keepdim=True)) - (base_logits_TE - base_logits_TE.mean(-1, keepdim=True))
    return _masked_mean_T(diff_TE.pow(2).sum(-1), valid_T)


# ---- the routing-level and output-level anchors (the base's own forward as teacher) ----------------------------


#: ``anchor.routes_loss``, the stored-routes forms of routing-kd: ``bucket`` (the base's probabilities at the stored
#: experts and one bucket for the rest; 0 at the base), ``hinge`` (ids alone: the selection rule's margin, 0 wherever
#: the model's rule returns the base's set), ``topk-kl`` (the probabilities renormalised over the stored experts: not
#: 0 at the base), ``set-ce`` (ids alone: the set cross-entropy, not 0 at the base)
ROUTES_LOSSES = ("bucket", "hinge", "topk-kl", "set-ce")
#: the forms that read the base's probabilities (a route file from ``rpb routes --with-probs``)
ROUTES_LOSSES_WITH_PROBS = ("bucket", "topk-kl")


def routes_loss_form(asked: str | None, with_probs: bool) -> str:
    """The stored-routes form a run uses: the one asked for, else ``bucket`` where the file has the base's
    probabilities and ``hinge`` where it has ids alone (the two forms that are 0 at the base)."""
    return asked if asked is not None else ("bucket" if with_probs else "hinge")


def routing_kd_topk(
    logits_TE: torch.Tensor,
    base_ids_TK: torch.Tensor,
    base_probs_TK: torch.Tensor | None,
    valid_T: torch.Tensor,
    transform: str,
) -> torch.Tensor:
    """``routing-kd`` from stored routes: the base's top-k experts of each token (``base_ids_TK``) against the
    current router's distribution p. With the base's probabilities at those experts (``base_probs_TK``, renormalised
    here over the k to q̂), sum_k q̂_k (log q̂_k - log p_k): the KL of the base's top-k part; with ids alone the set
    cross-entropy, -mean_k log p_k. Both reach 0 only where p puts all its mass on the base's experts (the
    ids alone) or matches q̂ there, so the term pulls the routing towards the base's choice, not towards its
    logits."""
    log_p_TE = router_probs(logits_TE, transform).clamp_min(1e-30).log()
    log_p_TK = log_p_TE.gather(-1, base_ids_TK.long())
    if base_probs_TK is None:
        return _masked_mean_T(-log_p_TK.mean(-1), valid_T)
    q_TK = base_probs_TK.float()
    q_TK = q_TK / q_TK.sum(-1, keepdim=True).clamp_min(1e-30)
    return _masked_mean_T((q_TK * (q_TK.clamp_min(1e-30).log() - log_p_TK)).sum(-1), valid_T)


def routing_kd_bucket(
    logits_TE: torch.Tensor,
    base_ids_TM: torch.Tensor,
    base_probs_TM: torch.Tensor,
    valid_T: torch.Tensor,
    transform: str,
) -> torch.Tensor:
    """``routing-kd`` from stored routes with the base's probabilities, 0 at the base: both distributions coarsened
    to the M stored experts plus one bucket for the rest, q = (q_m, 1 - sum_m q_m) from the base's stored
    probabilities (as stored: not renormalised) and p the same from the current router, and KL(q || p) summed over
    the M + 1 cells. It is 0 exactly where the model's coarsened routing equals the base's, so at the base itself,
    and with M = E (the whole distribution stored) it is online ``routing-kd``'s KL."""
    p_TE = router_probs(logits_TE, transform)
    p_TM = p_TE.gather(-1, base_ids_TM.long())
    q_TM = base_probs_TM.float()
    q_rest_T = (1.0 - q_TM.sum(-1)).clamp_min(0.0)
    p_rest_T = (1.0 - p_TM.sum(-1)).clamp_min(0.0)
    stored_T = (q_TM * (q_TM.clamp_min(1e-30).log() - p_TM.clamp_min(1e-30).log())).sum(-1)
    if base_ids_TM.shape[-1] == logits_TE.shape[-1]:  # every expert stored: no rest, only its rounding left out
        return _masked_mean_T(stored_T, valid_T)
    rest_T = q_rest_T * (q_rest_T.clamp_min(1e-30).log() - p_rest_T.clamp_min(1e-30).log())
    return _masked_mean_T(stored_T + rest_T, valid_T)


def selection_scores(logits_TE: torch.Tensor, spec: RouterSpec, expert_bias_E: torch.Tensor | None) -> torch.Tensor:
    """What the family's rule ranks experts by, in a scale the hinge reads: a sigmoid router's scores plus its
    expert-correction bias (the rule's own numbers), a softmax router's logits (the same ranking as its
    probabilities, within groups scored by their best expert too, and a margin in log-probability), a
    ``topk-softmax`` router's logits (what it selects on)."""
    if spec.score_function == "sigmoid":
        s_TE = logits_TE.float().sigmoid()
        return s_TE if expert_bias_E is None else s_TE + expert_bias_E.float()
    return logits_TE.float()


def hinge_refusal(spec: RouterSpec) -> str | None:
    """Why the hinge cannot express a router's selection rule (None: it can): groups scored by the sum of their two
    best softmax probabilities rank otherwise than the same sum of logits."""
    if spec.group_scoring == "top2-sum" and spec.score_function != "sigmoid":
        return (
            f"anchor.routes_loss=hinge: groups scored by top2-sum over {spec.score_function} scores rank otherwise "
            "than their logits' sum, which the hinge reads; use set-ce, or routes with probabilities (bucket)"
        )
    return None


def routing_kd_hinge(
    logits_TE: torch.Tensor,
    base_ids_TK: torch.Tensor,
    valid_T: torch.Tensor,
    spec: RouterSpec,
    expert_bias_E: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """``routing-kd`` from ids alone, 0 wherever the model's own rule returns the base's set: ``(term, active_T)``.

    On the rule's selection scores s (``selection_scores``), per token: relu(max s over the other experts the rule
    could pick - min s over the base's k), the others being those of the groups the model's rule keeps where the
    family routes by groups; there, also relu(the group score the base's weakest group must beat - its score),
    the bar being the best group outside the base's that the rule would keep in place of one of them (the
    ``topk_groups - b + 1``-th best such, b the groups the base's k sit in). Both are 0 when the rule returns the
    base's set (ties included) and positive only where it is being lost, so the gradient moves only the base's
    weakest expert (and group) up and its strongest rival down. ``active_T``: the valid tokens where it is
    positive."""
    if (why := hinge_refusal(spec)) is not None:
        raise ValueError(why)
    s_TE = selection_scores(logits_TE, spec, expert_bias_E)
    T, E = s_TE.shape
    base_TE = torch.zeros(T, E, dtype=torch.bool, device=s_TE.device).scatter_(1, base_ids_TK.long(), True)
    weakest_T = s_TE.masked_fill(~base_TE, float("inf")).min(-1).values
    rivals_TE = ~base_TE
    term_T = torch.zeros(T, device=s_TE.device)
    if spec.group_scoring is not None:
        G, per = spec.num_groups, E // spec.num_groups
        kept_TG = kept_groups(s_TE.detach(), spec)  # the groups the model's rule keeps: where its rivals are
        rivals_TE = rivals_TE & kept_TG.repeat_interleave(per, dim=1)
        grouped_TGe = s_TE.view(T, G, per)
        g_TG = grouped_TGe.topk(2, dim=-1)[0].sum(-1) if spec.group_scoring == "top2-sum" else grouped_TGe.amax(-1)
        base_TG = base_TE.view(T, G, per).any(-1)
        weakest_group_T = g_TG.masked_fill(~base_TG, float("inf")).min(-1).values
        others_TG = g_TG.masked_fill(base_TG, float("-inf")).sort(-1, descending=True).values
        at_T = (spec.topk_groups - base_TG.sum(-1)).clamp(0, G - 1)
        bar_T = others_TG.gather(1, at_T[:, None]).squeeze(1)
        term_T = term_T + torch.where(bar_T.isfinite(), (bar_T - weakest_group_T).clamp_min(0), term_T)
    rival_T = s_TE.masked_fill(~rivals_TE, float("-inf")).max(-1).values
    term_T = term_T + torch.where(rival_T.isfinite(), (rival_T - weakest_T).clamp_min(0), torch.zeros_like(term_T))
    return _masked_mean_T(term_T, valid_T), (term_T > 0) & (valid_T > 0)


def hidden_kd(hidden_TH: torch.Tensor, base_hidden_TH: torch.Tensor, valid_T: torch.Tensor) -> torch.Tensor:
    """``hidden-kd``'s term at one MoE layer: the mean over the counted tokens of ||h - h_base||^2 over the mean of
    ||h_base||^2, h the router's input in the model's forward and h_base the base's at the same router in its own
    forward: the drift of the hidden states relative to their size, with no routing in it."""
    h_TH = hidden_TH.reshape(-1, hidden_TH.shape[-1]).float()
    drift = _masked_mean_T((h_TH - base_hidden_TH.float()).pow(2).sum(-1), valid_T)
    return drift / _masked_mean_T(base_hidden_TH.float().pow(2).sum(-1), valid_T).clamp_min(1e-30)


def output_kd(logits_BTV: torch.Tensor, base_logits_BTV: torch.Tensor, labels_BT: torch.Tensor) -> torch.Tensor:
    """``output-kd``: mean over the language-model loss's tokens of KL(base next-token distribution || the model's).
    Position t predicts token t + 1, so it counts where ``labels_BT[:, t + 1]`` is not -100 (the tokens the
    loss trains: the answers under ``loss_on="answer"``), as the causal-LM loss pairs them."""
    keep_BT = torch.zeros_like(labels_BT, dtype=torch.bool)
    keep_BT[:, :-1] = labels_BT[:, 1:] != -100
    log_p = torch.log_softmax(logits_BTV[keep_BT].float(), dim=-1)
    log_q = torch.log_softmax(base_logits_BTV[keep_BT].float(), dim=-1)
    per_token = (log_q.exp() * (log_q - log_p)).sum(-1)
    return per_token.sum() / max(per_token.numel(), 1)
