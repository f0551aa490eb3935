"""``rpb.routing`` against the routers of transformers and against per-family references.

The references below are written from the transformers router sources
(``DeepseekV3TopkRouter``, ``DeepseekV2TopkRouter``, ``Qwen3MoeTopKRouter``,
``Qwen2MoeTopKRouter``, ``MixtralTopKRouter``, ``OlmoeTopKRouter``): the selection scores
come from the family's score function in float32 (as the routers compute them), and
everything after that -- group ranking, group masking, top-k, gate formula -- is done
token by token on Python floats, with the gates in float64. They read the router's own
attributes and never call ``rpb.routing``.
"""

from __future__ import annotations

import copy
import math

import pytest
import torch

from rpb.adapters import find_moe_layers, get_adapter, router_spec
from rpb.routing import route, select, select_from_prior
from rpb.testing.models import ARCHITECTURES, build_tiny_model

VOCAB = 64
NUM_TOKENS = 48


def tiny_routers(arch: str, seed: int = 0):
    """(model, facts, [router modules]) of a seeded tiny model of ``arch``."""
    model = build_tiny_model(arch, vocab_size=VOCAB, seed=seed)
    facts = get_adapter(model.config.model_type)
    return model, facts, [m.router for m in find_moe_layers(model, facts)]


def expert_bias_of(router, facts):
    return getattr(router, facts.expert_bias) if facts.expert_bias else None


def random_hidden(router, num_tokens: int = NUM_TOKENS, seed: int = 0, dtype=torch.float32):
    gen = torch.Generator().manual_seed(seed)
    return torch.randn(num_tokens, router.weight.shape[1], generator=gen).to(dtype)


pytestmark = pytest.mark.usefixtures("one_thread")

# --------------------------------------------------------------------------- references


def _top(values: list[float], candidates: list[int], k: int) -> list[int]:
    """The ``k`` candidates with the largest values, failing on a tie at the cut."""
    ranked = sorted(candidates, key=lambda e: -values[e])
    if len(ranked) > k:
        assert values[ranked[k - 1]] != values[ranked[k]], "tie at the top-k cut: choose another seed"
    return sorted(ranked[:k])


def _kept_experts(choice: list[float], num_groups: int, topk_group: int, group_score) -> list[int]:
    per_group = len(choice) // num_groups
    groups = [list(range(g * per_group, (g + 1) * per_group)) for g in range(num_groups)]
    group_values = [group_score([choice[e] for e in members]) for members in groups]
    kept = _top(group_values, list(range(num_groups)), topk_group)
    return [e for g in kept for e in groups[g]]


def _sigmoid(x: float) -> float:
    return 1.0 / (1.0 + math.exp(-x))


def _softmax(row: list[float]) -> list[float]:
    m = max(row)
    ex = [math.exp(v - m) for v in row]
    s = sum(ex)
    return [v / s for v in ex]


def _sum_of_best_two(values: list[float]) -> float:
    return sum(sorted(values, reverse=True)[:2])


def _select_deepseek_v3(router, choice_logits_TE):
    choice_TE = torch.sigmoid(choice_logits_TE.float()) + router.e_score_correction_bias.float()
    ids = []
    for choice in choice_TE.tolist():
        allowed = _kept_experts(choice, router.num_group, router.topk_group, _sum_of_best_two)
        ids.append(_top(choice, allowed, router.top_k))
    return torch.tensor(ids)


def _gates_deepseek_v3(router, logits_TE, ids_TK):
    gates = []
    for z, chosen in zip(logits_TE.double().tolist(), ids_TK.tolist(), strict=True):
        g = [_sigmoid(z[e]) for e in chosen]  # no expert-correction bias in the gates
        if router.norm_topk_prob:
            total = sum(g) + 1e-20
            g = [v / total for v in g]
        gates.append([v * router.routed_scaling_factor for v in g])
    return torch.tensor(gates, dtype=torch.float64)


def _select_deepseek_v2(router, choice_logits_TE):
    choice_TE = torch.softmax(choice_logits_TE.float(), dim=-1)
    ids = []
    for choice in choice_TE.tolist():
        allowed = list(range(len(choice)))
        if router.topk_method == "group_limited_greedy":
            allowed = _kept_experts(choice, router.num_group, router.topk_group, max)
        ids.append(_top(choice, allowed, router.top_k))
    return torch.tensor(ids)


def _gates_deepseek_v2(router, logits_TE, ids_TK):
    gates = []
    for z, chosen in zip(logits_TE.double().tolist(), ids_TK.tolist(), strict=True):
        p = _softmax(z)
        gates.append([p[e] * router.routed_scaling_factor for e in chosen])  # never renormalised
    return torch.tensor(gates, dtype=torch.float64)


def _select_softmax_topk(router, choice_logits_TE):
    choice_TE = torch.softmax(choice_logits_TE.float(), dim=-1)
    return torch.tensor([_top(choice, list(range(len(choice))), router.top_k) for choice in choice_TE.tolist()])


def _gates_softmax(logits_TE, ids_TK, normalize: bool):
    gates = []
    for z, chosen in zip(logits_TE.double().tolist(), ids_TK.tolist(), strict=True):
        p = _softmax(z)
        g = [p[e] for e in chosen]
        gates.append([v / sum(g) for v in g] if normalize else g)
    return torch.tensor(gates, dtype=torch.float64)


def _select_logits_topk(router, choice_logits_TE):
    """gpt-oss: the top-k of the logits themselves (its router bias is inside them)."""
    return torch.tensor([_top(z, list(range(len(z))), router.top_k) for z in choice_logits_TE.float().tolist()])


def _gates_softmax_of_chosen(router, logits_TE, ids_TK):
    """gpt-oss: the softmax over the chosen experts' logits alone."""
    gates = []
    for z, chosen in zip(logits_TE.double().tolist(), ids_TK.tolist(), strict=True):
        gates.append(_softmax([z[e] for e in chosen]))
    return torch.tensor(gates, dtype=torch.float64)


#: router class -> (selection on choice logits, gates on unbiased logits at given experts)
REFERENCES = {
    "DeepseekV3TopkRouter": (_select_deepseek_v3, _gates_deepseek_v3),
    "DeepseekV2TopkRouter": (_select_deepseek_v2, _gates_deepseek_v2),
    "Qwen3MoeTopKRouter": (_select_softmax_topk, lambda r, z, ids: _gates_softmax(z, ids, r.norm_topk_prob)),
    "Qwen2MoeTopKRouter": (_select_softmax_topk, lambda r, z, ids: _gates_softmax(z, ids, r.norm_topk_prob)),
    "OlmoeTopKRouter": (_select_softmax_topk, lambda r, z, ids: _gates_softmax(z, ids, r.norm_topk_prob)),
    # Mixtral always renormalises
    "MixtralTopKRouter": (_select_softmax_topk, lambda r, z, ids: _gates_softmax(z, ids, True)),
    # GLM-4.5: DeepSeek-V3's rule, written in its own modeling file the same way
    "Glm4MoeTopkRouter": (_select_deepseek_v3, _gates_deepseek_v3),
    "GptOssTopKRouter": (_select_logits_topk, _gates_softmax_of_chosen),
    # Qwen3.5-MoE always renormalises too (its router has no norm_topk_prob)
    "Qwen3_5MoeTopKRouter": (_select_softmax_topk, lambda r, z, ids: _gates_softmax(z, ids, True)),
}


def _select_minimax_m2(router, choice_logits_TE, block_bias_E):
    """MiniMax-M2: the top-k of sigmoid scores plus the bias its MoE block hands the router; no groups."""
    choice_TE = torch.sigmoid(choice_logits_TE.float()) + block_bias_E.float()
    return torch.tensor([_top(choice, list(range(len(choice))), router.top_k) for choice in choice_TE.tolist()])


def _gates_sigmoid_renormalised(router, logits_TE, ids_TK):
    gates = []
    for z, chosen in zip(logits_TE.double().tolist(), ids_TK.tolist(), strict=True):
        g = [_sigmoid(z[e]) for e in chosen]  # the block's bias selects only
        gates.append([v / sum(g) for v in g])
    return torch.tensor(gates, dtype=torch.float64)


#: routers whose expert-correction bias comes from their MoE block, as their forward's second argument
BLOCK_BIAS_REFERENCES = {"MiniMaxM2TopKRouter": (_select_minimax_m2, _gates_sigmoid_renormalised)}


def reference_gates(router, logits_TE: torch.Tensor, ids_TK: torch.Tensor) -> torch.Tensor:
    """float64 gates of the family at the given experts, from the unbiased logits."""
    return REFERENCES[type(router).__name__][1](router, logits_TE, ids_TK)


def reference_route(router, logits_TE: torch.Tensor, bias_TE: torch.Tensor, block_bias_E=None):
    """``(ids_TK ascending, gates_TK float64 aligned to them)``: the family's pipeline on ``logits + bias``
    for the selection and on the unbiased logits for the gates (``block_bias_E``: what a MiniMax-M2 block
    handed its router)."""
    if type(router).__name__ in BLOCK_BIAS_REFERENCES:
        select_ref, gates_ref = BLOCK_BIAS_REFERENCES[type(router).__name__]
        ids_TK = select_ref(router, logits_TE + bias_TE, block_bias_E)
        return ids_TK, gates_ref(router, logits_TE, ids_TK)
    ids_TK = REFERENCES[type(router).__name__][0](router, logits_TE + bias_TE)
    return ids_TK, reference_gates(router, logits_TE, ids_TK)


def canonical(gates_TK: torch.Tensor, ids_TK: torch.Tensor):
    """Experts sorted ascending per token, gates reordered alike (top-k order carries no meaning)."""
    ids_sorted, order = ids_TK.sort(dim=-1)
    return gates_TK.gather(1, order), ids_sorted


# --------------------------------------------------------------------------- (a) zero bias


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("arch", sorted(ARCHITECTURES))
def test_zero_bias_reproduces_the_router_bit_exactly(arch, dtype):
    _, facts, routers = tiny_routers(arch)
    for i, router in enumerate(routers):
        router = copy.deepcopy(router).to(dtype)
        logits_TE, gates_TK, ids_TK = router(random_hidden(router, seed=i, dtype=dtype))
        spec = router_spec(router, facts)
        expert_bias_E = expert_bias_of(router, facts)
        for bias_TE in (None, torch.zeros_like(logits_TE), -0.0 * torch.ones_like(logits_TE)):
            got_gates, got_ids = route(logits_TE, spec, bias_TE, expert_bias_E)
            assert torch.equal(got_ids, ids_TK)
            assert got_gates.dtype == gates_TK.dtype
            assert torch.equal(got_gates, gates_TK)


def test_deepseek_v2_greedy_switch_turns_groups_off():
    _, facts, routers = tiny_routers("deepseek_v2")
    router = copy.deepcopy(routers[0])
    router.topk_method, router.topk_group = "greedy", 1  # one kept group would change the selection
    logits_TE, gates_TK, ids_TK = router(random_hidden(router))
    spec = router_spec(router, facts)
    assert spec.group_scoring is None
    got_gates, got_ids = route(logits_TE, spec, torch.zeros_like(logits_TE))
    assert torch.equal(got_ids, ids_TK) and torch.equal(got_gates, gates_TK)


# --------------------------------------------------------------------------- (b) random bias


@pytest.mark.parametrize("arch", sorted(ARCHITECTURES))
def test_biased_selection_and_unbiased_gates_match_the_family_reference(arch):
    _, facts, routers = tiny_routers(arch)
    gen = torch.Generator().manual_seed(7)
    for i, router in enumerate(routers):
        with torch.no_grad():
            logits_TE, _, native_ids_TK = router(random_hidden(router, seed=10 + i))
        bias_TE = torch.randn(logits_TE.shape, generator=gen) * 3.0
        spec = router_spec(router, facts)
        gates_TK, ids_TK = route(logits_TE, spec, bias_TE, expert_bias_of(router, facts))
        assert ids_TK.shape == gates_TK.shape == (NUM_TOKENS, router.top_k)

        ref_ids, ref_gates = reference_route(router, logits_TE, bias_TE)
        got_gates, got_ids = canonical(gates_TK, ids_TK)
        assert torch.equal(got_ids, ref_ids)
        torch.testing.assert_close(got_gates.double(), ref_gates, rtol=1e-5, atol=1e-6)
        # the bias really moved the selection (the comparison is not the native routing again)
        changed = (native_ids_TK.sort(dim=-1).values != got_ids).any(dim=-1)
        assert changed.sum() >= NUM_TOKENS // 4
        # select alone gives the same experts
        assert torch.equal(select(logits_TE, spec, bias_TE, expert_bias_of(router, facts)), ids_TK)


@pytest.mark.parametrize("arch", sorted(ARCHITECTURES))
def test_reference_reproduces_the_native_router_on_zero_bias(arch):
    """The references themselves agree with transformers (so (b) compares against the right pipeline)."""
    _, _, routers = tiny_routers(arch)
    for i, router in enumerate(routers):
        with torch.no_grad():
            logits_TE, gates_TK, ids_TK = router(random_hidden(router, seed=20 + i))
        ref_ids, ref_gates = reference_route(router, logits_TE, torch.zeros_like(logits_TE))
        native_gates, native_ids = canonical(gates_TK, ids_TK)
        assert torch.equal(native_ids, ref_ids)
        torch.testing.assert_close(native_gates.double(), ref_gates, rtol=1e-5, atol=1e-6)


# --------------------------------------------------------------------------- (c) expert bias


@pytest.mark.parametrize("arch", ["moonlight", "deepseek_v3_grouped"])
def test_expert_bias_selects_but_never_weights(arch):
    _, facts, routers = tiny_routers(arch)
    router = copy.deepcopy(routers[0])
    favoured = 5
    with torch.no_grad():
        router.e_score_correction_bias.zero_()
        router.e_score_correction_bias[favoured] = 10.0  # beats any sigmoid score in [0, 1]
        logits_TE, native_gates_TK, native_ids_TK = router(random_hidden(router, seed=3))
    spec = router_spec(router, facts)

    _, without_ids = route(logits_TE, spec, None, None)
    assert not (without_ids == favoured).any(dim=-1).all()  # not chosen for every token on its own

    gates_TK, ids_TK = route(logits_TE, spec, None, router.e_score_correction_bias)
    assert (ids_TK == favoured).any(dim=-1).all()
    assert torch.equal(ids_TK, native_ids_TK) and torch.equal(gates_TK, native_gates_TK)

    # gates by hand: sigmoid(z) at the chosen experts / their sum * scaling, no expert bias anywhere
    s_TK = torch.sigmoid(logits_TE.double()).gather(1, ids_TK)
    by_hand = s_TK / (s_TK.sum(-1, keepdim=True) + 1e-20) * router.routed_scaling_factor
    torch.testing.assert_close(gates_TK.double(), by_hand, rtol=1e-6, atol=1e-7)
    # ... and not the formula with the expert bias inside (that would put ~scaling on the favoured expert)
    biased_s_TK = (torch.sigmoid(logits_TE.double()) + router.e_score_correction_bias.double()).gather(1, ids_TK)
    wrong = biased_s_TK / biased_s_TK.sum(-1, keepdim=True) * router.routed_scaling_factor
    assert (gates_TK.double() - wrong).abs().max() > 0.1
    favoured_gate_T = gates_TK.double()[ids_TK == favoured]
    assert favoured_gate_T.max() < router.routed_scaling_factor * 0.999

    # a prior bias acts inside the score function, the expert bias outside it: a -inf-like logit bias
    # cannot push the favoured expert out (sigmoid >= 0, +10 still wins)
    push_out_TE = torch.zeros_like(logits_TE)
    push_out_TE[:, favoured] = -1e4
    _, ids_TK = route(logits_TE, spec, push_out_TE, router.e_score_correction_bias)
    assert (ids_TK == favoured).any(dim=-1).all()


# --------------------------------------------------------------------------- (d) groups


def _router_reading_logits(router, logits_E: list[float]):
    """A copy of ``router`` whose logits equal ``logits_E`` for a one-hot-padded hidden state."""
    router = copy.deepcopy(router)
    E, H = router.weight.shape
    with torch.no_grad():
        router.weight.zero_()
        router.weight[:, :E] = torch.eye(E)
        if hasattr(router, "e_score_correction_bias"):
            router.e_score_correction_bias.zero_()
    hidden = torch.zeros(1, H)
    hidden[0, :E] = torch.tensor(logits_E)
    return router, hidden


def test_deepseek_v3_groups_exclude_the_single_best_expert_of_a_weak_group():
    _, facts, routers = tiny_routers("deepseek_v3_grouped")
    # 4 groups of 4, keep 2 groups, top-4. Group scores (sum of two best sigmoids): g0 ~1.905,
    # g1 ~1.848, g2 ~0.013, g3 ~0.982 (one strong expert, 12, the best expert overall).
    logits = [3.0, 3.0, -5, -5, 2.5, 2.5, -5, -5, -5, -5, -5, -5, 4.0, -9, -9, -9]
    router, hidden = _router_reading_logits(routers[0], logits)
    logits_TE, native_gates_TK, native_ids_TK = router(hidden)
    spec = router_spec(router, facts)
    assert (spec.num_groups, spec.topk_groups, spec.top_k) == (4, 2, 4)

    gates_TK, ids_TK = route(logits_TE, spec, None, router.e_score_correction_bias)
    assert sorted(ids_TK[0].tolist()) == [0, 1, 4, 5]  # plain top-4 would take 12 instead of 4 or 5
    assert sorted(torch.topk(logits_TE, 4).indices[0].tolist()) == [0, 1, 4, 12]
    assert torch.equal(ids_TK, native_ids_TK) and torch.equal(gates_TK, native_gates_TK)

    # a prior bias that lifts expert 13 makes group 3 the best group (0.982 + ~1 > 1.905): experts 12
    # and 13 come in, group 1 goes out
    bias_TE = torch.zeros_like(logits_TE)
    bias_TE[0, 13] = 20.0
    gates_TK, ids_TK = route(logits_TE, spec, bias_TE, router.e_score_correction_bias)
    assert sorted(ids_TK[0].tolist()) == [0, 1, 12, 13]
    ref_ids, ref_gates = reference_route(router, logits_TE, bias_TE)
    got_gates, got_ids = canonical(gates_TK, ids_TK)
    assert torch.equal(got_ids, ref_ids)
    torch.testing.assert_close(got_gates.double(), ref_gates, rtol=1e-6, atol=1e-7)
    # expert 13's gate comes from its unbiased logit (-9): tiny, not the biased near-1 score
    s = torch.sigmoid(torch.tensor([3.0, 3.0, 4.0, -9.0], dtype=torch.float64))
    torch.testing.assert_close(got_gates[0].double(), s / s.sum() * 2.5, rtol=1e-6, atol=1e-7)


def test_deepseek_v2_groups_exclude_experts_of_losing_groups():
    _, facts, routers = tiny_routers("deepseek_v2")
    # 4 groups of 2; with one kept group the top-2 must both come from the group of the best expert,
    # even though experts 2 and 3 outscore expert 1.
    logits = [5.0, -5.0, 4.0, 4.0, -1.0, -1.0, -2.0, -2.0]
    router, hidden = _router_reading_logits(routers[0], logits)
    router.topk_group = 1
    logits_TE, native_gates_TK, native_ids_TK = router(hidden)
    spec = router_spec(router, facts)
    assert (spec.group_scoring, spec.num_groups, spec.topk_groups) == ("max", 4, 1)

    gates_TK, ids_TK = route(logits_TE, spec)
    assert sorted(ids_TK[0].tolist()) == [0, 1]
    assert torch.equal(ids_TK, native_ids_TK) and torch.equal(gates_TK, native_gates_TK)
    p = torch.softmax(torch.tensor(logits, dtype=torch.float64), -1)
    got_gates, _ = canonical(gates_TK, ids_TK)
    torch.testing.assert_close(got_gates[0].double(), p[[0, 1]] * router.routed_scaling_factor)

    # a bias on expert 6 makes group 3 the best group: both of its experts are chosen
    bias_TE = torch.zeros_like(logits_TE)
    bias_TE[0, 6] = 10.0
    gates_TK, ids_TK = route(logits_TE, spec, bias_TE)
    assert sorted(ids_TK[0].tolist()) == [6, 7]
    got_gates, _ = canonical(gates_TK, ids_TK)
    torch.testing.assert_close(got_gates[0].double(), p[[6, 7]] * router.routed_scaling_factor)


def test_tiny_deepseek_v2_groups_are_live():
    """With the tiny config (2 of 4 groups, top-2) the group mask changes nothing for top-2; with one
    kept group the random routers give some tokens a different selection than the plain top-k."""
    _, facts, routers = tiny_routers("deepseek_v2")
    router = copy.deepcopy(routers[0])
    router.topk_group = 1
    logits_TE, _, ids_TK = router(random_hidden(router, seed=4))
    spec = router_spec(router, facts)
    assert torch.equal(route(logits_TE, spec)[1], ids_TK)
    plain = torch.topk(logits_TE, 2).indices.sort(-1).values
    assert (plain != ids_TK.sort(-1).values).any()
    groups_TK = ids_TK // 2
    assert (groups_TK[:, 0] == groups_TK[:, 1]).all()


# --------------------------------------------------------------------------- hard selection


def test_select_from_prior_takes_the_prior_top_k():
    prior_TE = torch.tensor([[0.1, 0.4, 0.05, 0.3, 0.15], [0.5, 0.0, 0.2, 0.1, 0.2 + 1e-3]])
    ids = select_from_prior(prior_TE, 2).sort(-1).values
    assert ids.tolist() == [[1, 3], [0, 4]]
