"""The anchors on megatron-core's ``TopKRouter.routing`` (selection), on CPU: semantics against
per-token references, beta 0 bit-identical, padding, hard anchors, parity with the HF path,
recomputation and removal, refusals."""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("megatron.core", reason="megatron-core is an optional extra: pip install 'rpb[megatron]'")

from megatron.core.transformer.moe import moe_utils
from megatron.core.transformer.moe.router import TopKRouter

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


@pytest.mark.parametrize("name", [*HF_SPECS, "deepseek-v2-group-limited-greedy"])
def test_parity_with_hf_path(name):
    if name not in HF_SPECS:
        pytest.skip(
            "DeepSeek-V2's group-limited greedy ranks each group by its best score (HF), megatron-core by "
            "the sum of its top topk // group_topk scores: the two frameworks define this routing differently"
        )
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

    routers = build_routers(case)
    handle = install_megatron_anchor(routers, AnchorConfig(method="sft"))
    with pytest.raises(MegatronAnchorError, match="already installed"):
        install_megatron_anchor(routers, AnchorConfig(method="sft"))
    handle.remove()
    with pytest.raises(MegatronAnchorError, match=r"does not fit the model's 2 routers x 8 experts"):
        install_megatron_anchor(routers, AnchorConfig(method="rpb"), prior=make_prior()[:, :, :1])
