"""The anchors on megatron-core's ``TopKRouter.routing`` (selection), on CPU: semantics against
per-token references, beta 0 bit-identical, padding, hard anchors, parity with the HF path,
recomputation and removal, refusals."""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch

pytest.importorskip("megatron.core", reason="megatron-core is an optional extra: pip install 'rpb[megatron]'")

from megatron.core.transformer.moe import moe_utils
from megatron.core.transformer.moe.router import TopKRouter

from rpb import routing
from rpb.adapters import get_adapter, router_spec
from rpb.anchors import AnchorConfig
from rpb.integrations.megatron import (
    MegatronAnchorError,
    install_megatron_anchor,
)
from rpb.routing import RouterSpec, route
from tests.integrations.megatron.routers import (
    CASES,
    SAMPLE_BS,
    SPAN_BS,
    B,
    Case,
    E,
    S,
    build_routers,
    check_against_reference,
    make_logits,
    make_prior,
    native_routing,
    sigmoid_of,
    token_bias,
    top_choice,
)


# ----------------------------------------------------------------------------- semantics
def test_padding_mask_true_means_padding():
    """Pin the installed megatron-core's padding convention, which the anchor follows."""
    logits = torch.randn(4, E)
    padding = torch.tensor([False, True, False, True])
    routing_map, scores = moe_utils.compute_routing_scores_for_aux_loss(logits, 2, "softmax", padding_mask=padding)
    assert not routing_map[padding].any() and not scores[padding].any()
    assert routing_map[~padding].sum(-1).tolist() == [2, 2]


@pytest.mark.parametrize("name", list(CASES))
def test_selection_only_against_reference(name):
    case = CASES[name]
    routers, pi, logits = build_routers(case), make_prior(), make_logits()
    handle = install_megatron_anchor(routers, AnchorConfig(method="rpb", beta=1.0), prior=pi)
    handle.set_micro_batch(SAMPLE_BS, SPAN_BS)
    check_against_reference(case, routers, logits, pi)
    # the bias moved some choices, and the combine weights carry gradient to the unbiased logits only
    native = native_routing(routers, logits)
    assert any(not torch.equal(r.routing(logits)[1], n[1]) for r, n in zip(routers, native, strict=True))
    z = logits.clone().requires_grad_(True)
    probs_TE, map_TE = routers[0].routing(z)
    (probs_TE * torch.arange(E)).sum().backward()
    ref_z = z.detach().clone().requires_grad_(True)
    ref_probs = megatron_weights(case, ref_z.reshape(-1, E), map_TE, routers[0].expert_bias)
    (ref_probs * torch.arange(E)).sum().backward()
    torch.testing.assert_close(z.grad, ref_z.grad, rtol=1e-5, atol=1e-6)
    # eval mode never sees the bias
    routers.eval()
    for r, n in zip(routers, native, strict=True):
        assert all(torch.equal(a, c) for a, c in zip(r.routing(logits.clone()), n, strict=True))
    handle.remove()


def megatron_weights(case: Case, z_TE, map_TE, expert_bias) -> torch.Tensor:
    """Differentiable combine weights for a fixed selection, written from megatron's formulas."""
    if case.score == "sigmoid":
        s = torch.sigmoid(z_TE) * map_TE
        w = s / (s.sum(-1, keepdim=True) + 1e-20)
    elif case.pre_softmax:
        w = torch.softmax(z_TE, -1) * map_TE
    else:
        w = torch.softmax(z_TE.masked_fill(~map_TE, float("-inf")), -1)
    return w * (case.scaling or 1.0)


@pytest.mark.parametrize("name", list(CASES))
def test_zero_bias_is_bit_identical_to_native(name):
    routers, pi, logits = build_routers(CASES[name]), make_prior(), make_logits()
    native = native_routing(routers, logits)
    handle = install_megatron_anchor(routers, AnchorConfig(method="rpb", beta=0.0), prior=pi)
    with handle.step(SAMPLE_BS, SPAN_BS):
        for r, n in zip(routers, native, strict=True):
            assert all(torch.equal(a, c) for a, c in zip(r.routing(logits.clone()), n, strict=True))
    handle.remove()


def test_padding_mask_tokens_stay_native():
    """Tokens the padding mask marks (True = padding) keep the native choice even if their ids say content."""
    case = CASES["softmax"]
    routers, pi, logits = build_routers(case), make_prior(), make_logits()
    padding = torch.zeros(S, B, dtype=torch.bool)
    padding[4:, 0] = True  # content A tokens of row 0
    handle = install_megatron_anchor(routers, AnchorConfig(method="rpb", beta=2.0), prior=pi)
    handle.set_micro_batch(SAMPLE_BS, SPAN_BS)
    check_against_reference(case, routers, logits, pi, beta=2.0, padding=padding)
    handle.remove()


def test_hard_method_forces_the_prior_top_k():
    case = CASES["sigmoid-bias-groups"]
    routers, pi, logits = build_routers(case), make_prior(), make_logits()
    handle = install_megatron_anchor(routers, AnchorConfig(method="rpb-hard"), prior=pi)
    handle.set_micro_batch(SAMPLE_BS, SPAN_BS)
    for pos, router in enumerate(routers):
        probs_TE, map_TE = router.routing(logits.clone())
        native_probs, native_map = TopKRouter.routing(router, logits.clone())
        for s in range(S):
            for b in range(B):
                t, span, sample = s * B + b, int(SPAN_BS[b, s]), int(SAMPLE_BS[b, s])
                if span < 0 or sample < 0:
                    assert torch.equal(map_TE[t], native_map[t]) and torch.equal(probs_TE[t], native_probs[t])
                    continue
                ids = top_choice(pi[sample, span, pos].tolist(), list(range(E)), case.topk)
                assert map_TE[t].nonzero().flatten().tolist() == ids
                sig = {e: sigmoid_of(float(logits[s, b, e])) for e in ids}
                for e in ids:
                    assert float(probs_TE[t, e]) == pytest.approx(2.5 * sig[e] / sum(sig.values()), abs=1e-6)
    handle.remove()


# ----------------------------------------------------------------------------- parity with the HF path
HF_SPECS = {
    # DeepSeek-V3 / Moonlight: sigmoid + expert bias, groups ranked by their best two, renormalised, scaled
    "sigmoid-bias-groups": RouterSpec(
        "sigmoid",
        4,
        E,
        group_scoring="top2-sum",
        num_groups=4,
        topk_groups=2,
        normalize=True,
        normalize_eps=1e-20,
        scaling=2.5,
        topk_sorted=False,
    ),
    # Mixtral-style: softmax, top-k, renormalised over the top-k (= megatron's softmax over the selected logits)
    "softmax": RouterSpec("softmax", 2, E, normalize=True),
    # softmax scores, groups by their best two (topk // group_topk = 2), no renormalisation, scaled
    "softmax-pre-groups": RouterSpec(
        "softmax", 4, E, group_scoring="top2-sum", num_groups=4, topk_groups=2, scaling=1.5
    ),
}


@pytest.mark.parametrize("name", list(HF_SPECS))
def test_parity_with_hf_path(name):
    case, spec = CASES[name], HF_SPECS[name]
    routers, pi, logits = build_routers(case), make_prior(), make_logits()
    handle = install_megatron_anchor(routers, AnchorConfig(method="rpb"), prior=pi)
    handle.set_micro_batch(SAMPLE_BS, SPAN_BS)
    logits_TE = logits.reshape(-1, E)
    for pos, router in enumerate(routers):
        probs_TE, map_TE = router.routing(logits.clone())
        bias_TE = torch.tensor([token_bias(pi, pos, t // B, t % B) for t in range(S * B)], dtype=torch.float32)
        gates_TK, ids_TK = route(logits_TE, spec, bias_TE, router.expert_bias)
        hf_map = torch.zeros(S * B, E, dtype=torch.bool).scatter_(1, ids_TK, True)
        assert torch.equal(map_TE, hf_map)
        torch.testing.assert_close(probs_TE.gather(1, ids_TK), gates_TK, rtol=1e-6, atol=1e-6)
    handle.remove()


# DeepSeek-V2's group-limited greedy has no parity case: transformers ranks each group by its best
# score, megatron-core by the sum of its best topk // group_topk scores (2 here, as in DeepSeek-V2's
# own 6 of 160 experts over 3 of 8 groups). Where those two rankings differ the two frameworks route
# differently, so a Megatron model configured like DeepSeek-V2 is not the HF model: the check below
# shows the divergence on values built for it, and agreement where the rankings coincide.
# Selection values (logits + bias) per micro-batch row, 4 groups of 2 experts:
# row 0: group 0 holds the best single score (3.0) but the weakest pair (e^3 + e^-5 = 20.09 against
#   e^2.5 + e^2.4 = 23.20 and e^2.4 + e^2.3 = 20.99): HF keeps groups 0, 1 -> experts 0-3;
#   megatron groups 1, 2 -> experts 2-5;
# row 1: groups 0 and 1 lead by both measures: both keep experts 0-3.
GROUP_VALUES_BE = torch.tensor([[3.0, -5.0, 2.5, 2.4, 2.4, 2.3, -1.0, -1.0], [3.0, 2.9, 2.5, 2.4, 1.0, 0.9, 0.0, -0.1]])


def deepseek_v2_router() -> torch.nn.Module:
    """transformers' own DeepSeek-V2 router with identity weights, so its logits are its input."""
    from transformers import DeepseekV2Config
    from transformers.models.deepseek_v2.modeling_deepseek_v2 import DeepseekV2TopkRouter

    config = DeepseekV2Config(
        hidden_size=E, num_attention_heads=2, num_key_value_heads=2, n_routed_experts=E, num_experts_per_tok=4,
        n_group=4, topk_group=2, topk_method="group_limited_greedy", routed_scaling_factor=1.5,
    )  # fmt: skip
    router = DeepseekV2TopkRouter(config)
    with torch.no_grad():
        router.weight.copy_(torch.eye(E))
    return router


def check_deepseek_v2_groups_diverge_from_megatron() -> None:
    hf = deepseek_v2_router()
    spec = router_spec(hf, get_adapter("deepseek_v2"))  # the HF path's pipeline for this router
    case = CASES["softmax-pre-groups"]  # megatron's side: the same scores, top-k, groups and scaling
    assert (case.topk, case.num_groups, case.group_topk, case.scaling) == (4, 4, 2, 1.5) == (
        hf.top_k, hf.num_group, hf.topk_group, hf.routed_scaling_factor)  # fmt: skip
    routers, pi = build_routers(case), make_prior()
    handle = install_megatron_anchor(routers, AnchorConfig(method="rpb"), prior=pi)
    handle.set_micro_batch(SAMPLE_BS, SPAN_BS)
    try:
        wanted_TE = GROUP_VALUES_BE.repeat(S, 1)  # router row t = s * B + b holds row b's values
        for pos, router in enumerate(routers):
            bias_TE = torch.tensor([token_bias(pi, pos, t // B, t % B) for t in range(S * B)], dtype=torch.float32)
            logits_TE = wanted_TE - bias_TE  # so that every token's logits + bias are the designed values
            probs_TE, map_TE = router.routing(logits_TE.reshape(S, B, E).clone())
            gates_TK, ids_TK = route(logits_TE, spec, bias_TE)
            with torch.no_grad():
                transformers_ids_TK = hf(logits_TE + bias_TE)[2]
            for t in range(S * B):
                hf_ids, megatron_ids = sorted(ids_TK[t].tolist()), map_TE[t].nonzero().flatten().tolist()
                assert hf_ids == sorted(transformers_ids_TK[t].tolist()), "the HF path is not transformers' rule"
                if t % B == 0:
                    assert (hf_ids, megatron_ids) == ([0, 1, 2, 3], [2, 3, 4, 5]), f"no divergence at row {t}"
                else:
                    assert hf_ids == megatron_ids == [0, 1, 2, 3], f"no agreement at row {t}"
                    torch.testing.assert_close(probs_TE[t, ids_TK[t]], gates_TK[t], rtol=1e-6, atol=1e-6)
    finally:
        handle.remove()


def test_deepseek_v2_group_limited_greedy_is_not_megatrons_group_routing():
    check_deepseek_v2_groups_diverge_from_megatron()


def test_mutant_hf_path_ranks_v2_groups_by_top2_sum_is_caught(monkeypatch):
    """The HF path scoring DeepSeek-V2's groups as DeepSeek-V3's (by their best two) routes like megatron."""
    original = routing.kept_groups
    monkeypatch.setattr(routing, "kept_groups", lambda c, spec: original(c, replace(spec, group_scoring="top2-sum")))
    with pytest.raises(AssertionError, match="transformers' rule"):
        check_deepseek_v2_groups_diverge_from_megatron()


def test_mutant_megatron_ranks_groups_by_best_score_is_caught(monkeypatch):
    """A megatron-core that ranked groups by their best score would agree with HF: the check says so
    (then DeepSeek-V2 deserves a parity case instead)."""

    def by_best_score(scores, topk, num_tokens, num_experts, num_groups, group_topk):
        best = scores.view(num_tokens, num_groups, -1).max(dim=-1).values
        kept = torch.zeros_like(best).scatter(1, torch.topk(best, k=group_topk, dim=-1)[1], 1).bool()
        keep = kept.unsqueeze(-1).expand(num_tokens, num_groups, num_experts // num_groups).reshape(num_tokens, -1)
        return torch.topk(scores.masked_fill(~keep, float("-inf")), k=topk, dim=-1)

    monkeypatch.setattr(moe_utils, "group_limited_topk", by_best_score)
    with pytest.raises(AssertionError, match="no divergence"):
        check_deepseek_v2_groups_diverge_from_megatron()


# ----------------------------------------------------------------------------- lifecycle
def test_context_survives_recomputation_and_removal_restores_the_router(caplog):
    case = CASES["sigmoid-bias-groups"]
    routers, pi, logits = build_routers(case), make_prior(), make_logits()
    rate = routers[0].config.moe_router_bias_update_rate
    native = native_routing(routers, logits)
    bias_before = [r.expert_bias.clone() for r in routers]
    with caplog.at_level("WARNING", logger="rpb.integrations.megatron.router"):
        handle = install_megatron_anchor(routers, AnchorConfig(method="rpb"), prior=pi)
    assert routers[0].config.moe_router_bias_update_rate == 0.0
    assert "kept frozen" in caplog.text and "kept frozen" in handle.notes[0]

    def loss_of(z, checkpointed: bool):
        fn = lambda x: routers[1].routing(x)[0]  # noqa: E731
        probs = torch.utils.checkpoint.checkpoint(fn, z, use_reentrant=False) if checkpointed else fn(z)
        return (probs * torch.arange(E)).sum()

    grads = []
    with handle.step(SAMPLE_BS, SPAN_BS):
        for checkpointed in (False, True):
            z = logits.clone().requires_grad_(True)
            loss_of(z, checkpointed).backward()  # recomputation runs routing again, inside the context
            grads.append(z.grad)
    torch.testing.assert_close(grads[0], grads[1], rtol=0, atol=0)
    assert all(torch.equal(r.expert_bias, b) for r, b in zip(routers, bias_before, strict=True))

    handle.remove()
    assert all("routing" not in vars(r) for r in routers)
    assert routers[0].config.moe_router_bias_update_rate == rate
    handle.set_micro_batch(SAMPLE_BS, SPAN_BS)  # a removed handle reaches no router
    for r, n in zip(routers, native, strict=True):
        assert all(torch.equal(a, c) for a, c in zip(r.routing(logits.clone()), n, strict=True))


@pytest.mark.parametrize("method", ["kl-to-base", "logit-l2", "router-l2", "lbl", "router-freeze", "sft"])
def test_the_loss_anchors_install_beside_megatrons_routing_replay(method):
    """Replay hands the router its recorded top-k; a loss anchor reads the live logits or the weights, so it may
    run beside it (docs/megatron.md); a prior selection may not (the next test)."""
    routers = build_routers(CASES["softmax"])
    for r in routers:
        r.router_replay = object()  # moe_enable_routing_replay=True: a RouterReplay on every router
    handle = install_megatron_anchor(routers, AnchorConfig.for_method(method, lambda_=1.0, lbl_coef=0.01))
    assert all("routing" in vars(r) for r in routers)
    handle.remove()
    with pytest.raises(MegatronAnchorError, match="replayed routes would override the biased selection"):
        install_megatron_anchor(routers, AnchorConfig(method="rpb"), prior=make_prior())


def test_install_refuses_with_every_problem_at_once():
    case = CASES["softmax"]
    routers = build_routers(case)
    routers[0].config.moe_router_fusion = True
    routers[0].config.context_parallel_size = 2
    routers[0].router_replay = object()
    with pytest.raises(MegatronAnchorError) as err:
        install_megatron_anchor(routers, AnchorConfig(method="rpb"), prior=make_prior())
    text = str(err.value)
    assert "moe_router_fusion" in text and "context_parallel_size=2" in text and "routing replay" in text
    assert all("routing" not in vars(r) for r in routers)

    routers = build_routers(case)  # a routing target is steered in the HF trainers only: refused, not ignored
    with pytest.raises(MegatronAnchorError, match=r"anchor\.target on Megatron-Core"):
        install_megatron_anchor(routers, AnchorConfig(method="routing-kd", target=0.9, base="routes", routes="r"))
    handle = install_megatron_anchor(routers, AnchorConfig(method="sft"))
    with pytest.raises(MegatronAnchorError, match="already installed"):
        install_megatron_anchor(routers, AnchorConfig(method="sft"))
    handle.remove()
    with pytest.raises(MegatronAnchorError, match=r"does not fit the model's 2 routers x 8 experts"):
        install_megatron_anchor(routers, AnchorConfig(method="rpb"), prior=make_prior()[:, :, :1])
