"""The anchors on megatron-core's ``TopKRouter``, run on CPU under a one-process gloo group.

Routers are built with ``use_cpu_initialization=True`` and a ``ProcessGroupCollection``; their
expert-bias buffers, which ``__init__`` allocates on ``torch.cuda.current_device()``, are built
on CPU here. The tests call ``router.routing(logits)`` -- the method the anchor replaces --
with logits ``[s, b, E]`` as ``TopKRouter.forward`` hands them over (``gating`` is the plain
router linear, and it moves weights to CUDA).

The references are written from megatron-core's routing semantics and computed token by
token on Python floats (scores, group ranking, top-k, combine weights); they never call
megatron or ``rpb``. The eq. 3 bias is computed by hand in float64.

The loss-based anchors run the router's whole ``forward`` (``gating`` + ``routing``) on hidden
states; without Transformer Engine megatron-core 0.16.1's router linear reads an undefined
``te_general_gemm``, which the tests set to None (the plain torch path). Their references are
the HF path's definitions written as plain torch formulas on leaf copies of the weights.

Shape legend: B micro-batch rows, S positions, T router rows (position * B + row), E experts,
H hidden size, K top-k.
"""

from __future__ import annotations

import contextlib
import dataclasses
import hashlib
import math
from dataclasses import dataclass

import pytest
import torch

pytest.importorskip("megatron.core", reason="megatron-core is an optional extra: pip install 'rpb[megatron]'")

from megatron.core.process_groups_config import ProcessGroupCollection
from megatron.core.transformer.moe import moe_utils
from megatron.core.transformer.moe.router import TopKRouter
from megatron.core.transformer.transformer_config import TransformerConfig

from rpb.anchors.handle import AnchorConfig
from rpb.anchors.verify import PriorMismatchError
from rpb.integrations.megatron import (
    ROUTED_ALL_BUT_LAST,
    ROUTED_ALL_POSITIONS,
    MegatronAnchorError,
    freeze_router_parameters,
    install_megatron_anchor,
    megatron_routers_sha256,
    megatron_run_facts,
    pack_thd,
    router_rows,
    verify_megatron_prior,
)
from rpb.routing import RouterSpec, route

E = 8
H = 16  # the routers' hidden size
NUM_PRIOR_ROWS = 3
LAYER_NUMBERS = (2, 3)  # Megatron numbers layers from 1; layer 1 is dense, as in Moonlight
# two rows of six positions; 0 = Q, 1 = A, -1 = structural; row 1 ends in two padding positions
SPAN_BS = torch.tensor([[-1, 0, 0, -1, 1, 1], [-1, 0, 1, 1, -1, -1]])
SAMPLE_BS = torch.tensor([[2] * 6, [0, 0, 0, 0, -1, -1]])
B, S = SPAN_BS.shape


@dataclass(frozen=True)
class Case:
    name: str
    score: str
    topk: int
    pre_softmax: bool = False
    expert_bias: bool = False
    num_groups: int | None = None
    group_topk: int | None = None
    scaling: float | None = None


CASES = {
    c.name: c
    for c in (
        Case("softmax", "softmax", topk=2),
        Case("softmax-pre-groups", "softmax", topk=4, pre_softmax=True, num_groups=4, group_topk=2, scaling=1.5),
        Case("sigmoid-bias-groups", "sigmoid", topk=4, expert_bias=True, num_groups=4, group_topk=2, scaling=2.5),
    )
}


@pytest.fixture(scope="module", autouse=True)
def gloo(tmp_path_factory):
    """One gloo process group for the module (megatron's routers hold process groups)."""
    dist = torch.distributed
    owned = not dist.is_initialized()
    if owned:
        store = tmp_path_factory.mktemp("gloo") / "store"
        dist.init_process_group("gloo", init_method=f"file://{store}", rank=0, world_size=1)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)
    if owned:
        dist.destroy_process_group()


@contextlib.contextmanager
def buffers_on_cpu():
    """TopKRouter.__init__ allocates its expert-bias buffers on torch.cuda.current_device()."""
    original = torch.cuda.current_device
    torch.cuda.current_device = lambda: "cpu"
    try:
        yield
    finally:
        torch.cuda.current_device = original


def process_groups() -> ProcessGroupCollection:
    pgs = ProcessGroupCollection()
    group = torch.distributed.new_group([0])
    for name in ("tp", "cp", "tp_cp", "tp_dp_cp", "ep", "dp", "dp_cp", "expt_tp", "expt_dp", "tp_ep", "pp"):
        setattr(pgs, name, group)
    return pgs


def build_routers(case: Case, seed: int = 0, **config) -> torch.nn.ModuleList:
    cfg = TransformerConfig(
        num_layers=max(LAYER_NUMBERS),
        hidden_size=H,
        num_attention_heads=2,
        use_cpu_initialization=True,
        num_moe_experts=E,
        moe_router_topk=case.topk,
        moe_router_score_function=case.score,
        moe_router_pre_softmax=case.pre_softmax,
        moe_router_enable_expert_bias=case.expert_bias,
        moe_router_num_groups=case.num_groups,
        moe_router_group_topk=case.group_topk,
        moe_router_topk_scaling_factor=case.scaling,
        moe_router_load_balancing_type="none",
        moe_aux_loss_coeff=0.0,
        **config,
    )
    pgs = process_groups()
    gen = torch.Generator().manual_seed(seed)
    routers = []
    with buffers_on_cpu():
        for number in LAYER_NUMBERS:
            router = TopKRouter(cfg, pg_collection=pgs)
            router.set_layer_number(number)
            if router.expert_bias is not None:
                router.expert_bias.copy_(0.3 * torch.randn(E, generator=gen))
            routers.append(router)
    return torch.nn.ModuleList(routers).train()


def make_prior(seed: int = 1) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    return torch.softmax(2.0 * torch.randn(NUM_PRIOR_ROWS, 2, len(LAYER_NUMBERS), E, generator=gen), -1)


def make_logits(seed: int = 2, rows: int = B, positions: int = S) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    return torch.randn(positions, rows, E, generator=gen)


def hand_bias(pi_E: torch.Tensor, eps: float = 0.05, clip: float = 5.0) -> list[float]:
    """Eq. 3 in float64: q = clamp(pi, eps/E, C/E) renormalised; b = log q - mean_e log q."""
    q = pi_E.double().clamp(eps / E, clip / E)
    log_q = (q / q.sum()).log()
    return (log_q - log_q.mean()).tolist()


def token_bias(pi: torch.Tensor, layer: int, s: int, b: int, beta: float = 1.0, padding=None) -> list[float]:
    """The bias token (s, b) must get: beta * b[x, span, layer] for Q/A content, nothing otherwise."""
    span, sample = int(SPAN_BS[b, s]), int(SAMPLE_BS[b, s])
    if span < 0 or sample < 0 or (padding is not None and bool(padding[s, b])):
        return [0.0] * E
    return [beta * v for v in hand_bias(pi[sample, span, layer])]


# ----------------------------------------------------------------------------- references
def _top(values: list[float], candidates: list[int], k: int) -> list[int]:
    ranked = sorted(candidates, key=lambda e: -values[e])
    if len(ranked) > k:
        assert values[ranked[k - 1]] - values[ranked[k]] > 1e-5, "near-tie at the top-k cut: choose another seed"
    return sorted(ranked[:k])


def _softmax(values: list[float]) -> list[float]:
    m = max(values)
    ex = [math.exp(v - m) for v in values]
    return [v / sum(ex) for v in ex]


def _sigmoid(v: float) -> float:
    return 1.0 / (1.0 + math.exp(-v))


def reference(case: Case, z: list[float], bias: list[float], expert_bias: list[float] | None):
    """(sorted expert ids, {id: combine weight}) by megatron-core's rules, on Python floats.

    Selection on z + bias: softmax without pre-softmax ranks the raw values, with pre-softmax
    their softmax, sigmoid its sigmoid plus the expert bias; group-limited top-k keeps the
    ``group_topk`` groups with the largest sum of their best ``topk // group_topk`` scores.
    Weights from the unbiased z: softmax over the selected logits / the selected softmax
    scores / the selected sigmoids over their sum (+1e-20); times the scaling factor.
    """
    zb = [a + c for a, c in zip(z, bias, strict=True)]
    if case.score == "sigmoid":
        choice = [_sigmoid(v) + (expert_bias[e] if expert_bias else 0.0) for e, v in enumerate(zb)]
    else:
        choice = _softmax(zb) if case.pre_softmax else zb
    candidates = list(range(E))
    if case.group_topk:
        per = E // case.num_groups
        group_value = [
            sum(sorted(choice[g * per : (g + 1) * per], reverse=True)[: case.topk // case.group_topk])
            for g in range(case.num_groups)
        ]
        kept = _top(group_value, list(range(case.num_groups)), case.group_topk)
        candidates = [e for g in kept for e in range(g * per, (g + 1) * per)]
    ids = _top(choice, candidates, case.topk)
    if case.score == "sigmoid":
        s = {e: _sigmoid(z[e]) for e in ids}
        weights = {e: v / (sum(s.values()) + 1e-20) for e, v in s.items()}
    elif case.pre_softmax:
        full = _softmax(z)
        weights = {e: full[e] for e in ids}
    else:
        weights = dict(zip(ids, _softmax([z[e] for e in ids]), strict=True))
    return ids, {e: w * (case.scaling or 1.0) for e, w in weights.items()}


def check_against_reference(case, routers, logits, pi, beta=1.0, padding=None):
    for pos, router in enumerate(routers):
        probs_TE, map_TE = router.routing(logits.clone(), padding_mask=padding)
        eb = router.expert_bias.tolist() if router.expert_bias is not None else None
        for s in range(S):
            for b in range(B):
                t = s * B + b
                ids, weights = reference(case, logits[s, b].tolist(), token_bias(pi, pos, s, b, beta, padding), eb)
                assert map_TE[t].nonzero().flatten().tolist() == ids, (case.name, pos, s, b)
                for e in range(E):
                    assert float(probs_TE[t, e]) == pytest.approx(weights.get(e, 0.0), abs=1e-6)


def native_routing(routers, logits, padding=None):
    return [TopKRouter.routing(r, logits.clone(), padding_mask=padding) for r in routers]


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
                ids = _top(pi[sample, span, pos].tolist(), list(range(E)), case.topk)
                assert map_TE[t].nonzero().flatten().tolist() == ids
                sig = {e: _sigmoid(float(logits[s, b, e])) for e in ids}
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


# ----------------------------------------------------------------------------- token layout
def test_router_rows_position_major_and_sequence_parallel_shards():
    ids_BS = torch.arange(2 * 8).reshape(2, 8)  # value = row * 8 + position
    assert router_rows(ids_BS).tolist() == [b * 8 + s for s in range(8) for b in range(2)]
    for rank in range(2):
        expected = [b * 8 + s for s in range(4 * rank, 4 * rank + 4) for b in range(2)]
        assert router_rows(ids_BS, rank, 2, sequence_parallel=True).tolist() == expected
    assert router_rows(ids_BS, 1, 2, sequence_parallel=False).tolist() == router_rows(ids_BS).tolist()
    with pytest.raises(ValueError, match="divisible"):
        router_rows(ids_BS[:, :7], 0, 2, sequence_parallel=True)


def test_sequence_parallel_split_over_two_ranks_matches_the_whole_micro_batch():
    """Each simulated TP rank routes its sequence shard; together they equal the unsplit micro-batch."""
    case = CASES["sigmoid-bias-groups"]
    routers, pi = build_routers(case), make_prior()
    sample_BS = torch.tensor([[1, 1, 1, 1, 1, 1, 1, 1], [2, 2, 2, 2, 2, 2, -1, -1]])
    span_BS = torch.tensor([[-1, 0, 0, 0, -1, 1, 1, 1], [-1, 0, 0, 1, 1, 1, -1, -1]])
    logits = make_logits(seed=5, rows=2, positions=8)
    whole = install_megatron_anchor(routers, AnchorConfig(method="rpb"), prior=pi)
    whole.set_micro_batch(sample_BS, span_BS)
    expected = [r.routing(logits.clone()) for r in routers]
    whole.remove()
    for rank in range(2):
        # one process: the routers' TP group has size 1, so the rank and the split are given explicitly
        handle = install_megatron_anchor(
            routers, AnchorConfig(method="rpb"), prior=pi, tp_rank=rank, tp_size=2, sequence_parallel=True
        )
        handle.set_micro_batch(sample_BS, span_BS)
        rows = slice(rank * 4 * 2, (rank + 1) * 4 * 2)  # positions [4 rank, 4 rank + 4) x 2 rows
        for r, (probs, rmap) in zip(routers, expected, strict=True):
            shard_probs, shard_map = r.routing(logits[rank * 4 : (rank + 1) * 4].clone())
            assert torch.equal(shard_map, rmap[rows]) and torch.equal(shard_probs, probs[rows])
        with pytest.raises(RuntimeError, match="saw 16 tokens"):
            routers[0].routing(logits.clone())  # the whole sequence is not this rank's shard
        handle.remove()


def test_pack_thd_places_each_sequence_at_its_cu_seqlens_slot():
    sample_BS, span_BS = pack_thd([4, 0], [[-1, 0, 1], [-1, 0, 0, 1]], torch.tensor([0, 4, 8]), total_len=10)
    assert sample_BS.tolist() == [[4, 4, 4, -1, 0, 0, 0, 0, -1, -1]]
    assert span_BS.tolist() == [[-1, 0, 1, -1, -1, 0, 0, 1, -1, -1]]
    with pytest.raises(ValueError, match="slot holds"):
        pack_thd([1], [[0, 0, 0]], torch.tensor([0, 2]))


def test_packed_micro_batch_routes_each_token_as_unpacked():
    """A THD micro-batch [1, 10] gives every token the bias of its own (sample, span)."""
    case = CASES["softmax"]
    routers, pi = build_routers(case), make_prior()
    spans = [[-1, 0, 0, 1], [-1, 0, 1, 1, 1]]
    sample_BS, span_BS = pack_thd([1, 2], spans, torch.tensor([0, 4, 9]), total_len=10)
    logits = make_logits(seed=7, rows=1, positions=10)
    handle = install_megatron_anchor(routers, AnchorConfig(method="rpb"), prior=pi)
    handle.set_micro_batch(sample_BS, span_BS)
    probs_TE, map_TE = routers[1].routing(logits.clone())
    for t in range(10):
        sample, span = int(sample_BS[0, t]), int(span_BS[0, t])
        bias = hand_bias(pi[sample, span, 1]) if span >= 0 else [0.0] * E
        ids, weights = reference(case, logits[t, 0].tolist(), bias, None)
        assert map_TE[t].nonzero().flatten().tolist() == ids
        assert [float(probs_TE[t, e]) for e in ids] == pytest.approx([weights[e] for e in ids], abs=1e-6)
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


# ----------------------------------------------------------------------------- loss-based anchors
LOSS_CONFIGS = {
    "lbl": AnchorConfig(method="lbl", lbl_coef=0.3),
    "router-l2": AnchorConfig(method="router-l2", lambda_=0.7),
    "kl-to-base": AnchorConfig(method="kl-to-base", lambda_=0.7),
    "logit-l2": AnchorConfig(method="logit-l2", lambda_=0.7),
}
#: a softmax router, and a sigmoid one whose kl-to-base reads the prior's sigmoid-normalized transform
LOSS_CASES = {"softmax": None, "sigmoid-bias-groups": "sigmoid-normalized"}


@pytest.fixture(autouse=True)
def router_linear_without_transformer_engine(monkeypatch):
    monkeypatch.setattr(moe_utils, "te_general_gemm", None, raising=False)


def make_hidden(seed: int = 3, rows: int = B, positions: int = S) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    return torch.randn(positions, rows, H, generator=gen)


def loss_config(method: str, case_name: str) -> AnchorConfig:
    cfg = LOSS_CONFIGS[method]
    return dataclasses.replace(cfg, router_transform=LOSS_CASES[case_name]) if method == "kl-to-base" else cfg


@contextlib.contextmanager
def drifted(routers, seed: int = 4, scale: float = 0.2):
    """Move every router weight and gating bias away from the installed base (as training would), then back."""
    gen = torch.Generator().manual_seed(seed)
    saved = [(p, p.detach().clone()) for r in routers for p in (r.weight, r.bias)]
    with torch.no_grad():
        for p, _ in saved:
            p.add_(scale * torch.randn(p.shape, generator=gen))
    try:
        yield
    finally:
        with torch.no_grad():
            for p, original in saved:
                p.copy_(original)  # exactly: adding and subtracting a delta need not round-trip


def forward(routers, hidden_SBH, padding_SB=None):
    """Each router's whole forward (gating, then routing), as the MoE layer calls it."""
    with buffers_on_cpu():  # gating moves a CPU weight to torch.cuda.current_device()
        return [r(hidden_SBH, padding_mask=padding_SB) for r in routers]


def valid_rows(sample_BS: torch.Tensor, padding_SB=None) -> torch.Tensor:
    """valid_T by hand: row t = s * B + b counts unless its sample is -1 or Megatron's mask marks it."""
    rows_B, positions = sample_BS.shape
    return torch.tensor(
        [
            bool(sample_BS[b, s] >= 0) and not (padding_SB is not None and bool(padding_SB[s, b]))
            for s in range(positions)
            for b in range(rows_B)
        ]
    )


def reference_router_term(method, case, transform, W_EH, b_E, W0_EH, b0_E, x_TH, valid_T) -> torch.Tensor:
    """One router's HF-path term, in plain torch: KL / centred logit L2 / load balancing / weight L2."""
    if method == "router-l2":
        return (W_EH - W0_EH).pow(2).sum() + (b_E - b0_E).pow(2).sum()
    z_TE, zb_TE, n = x_TH @ W_EH.T + b_E, x_TH @ W0_EH.T + b0_E, valid_T.sum()

    def dist(v_TE, kind):
        return torch.softmax(v_TE, -1) if kind == "softmax" else torch.sigmoid(v_TE) / torch.sigmoid(v_TE).sum(-1, True)

    if method == "kl-to-base":
        p_TE, pb_TE = dist(z_TE, transform or "softmax"), dist(zb_TE, transform or "softmax")
        return (pb_TE * (pb_TE.log() - p_TE.log())).sum(-1)[valid_T].sum() / n
    if method == "logit-l2":
        d_TE = (z_TE - z_TE.mean(-1, keepdim=True)) - (zb_TE - zb_TE.mean(-1, keepdim=True))
        return d_TE.pow(2).sum(-1)[valid_T].sum() / n
    # lbl: E * sum_e f_e P_e; f counts the plain top-k slots of valid tokens (divided by k for sigmoid)
    p_TE = dist(z_TE, case.score)
    slots_E = torch.zeros(E)
    for t in valid_T.nonzero().flatten().tolist():
        for e in torch.topk(p_TE[t].detach(), case.topk).indices.tolist():
            slots_E[e] += 1
    f_E = slots_E / (n * (case.topk if case.score == "sigmoid" else 1))
    return E * (f_E * p_TE[valid_T].sum(0) / n).sum()


def reference_loss(method, case_name, routers, bases, hidden_SBH, valid_T):
    """coef * mean over routers, and its gradients with respect to each router's weight and bias."""
    cfg, case = loss_config(method, case_name), CASES[case_name]
    coef = cfg.lbl_coef if method == "lbl" else cfg.lambda_
    leaves = [
        (r.weight.detach().clone().requires_grad_(True), r.bias.detach().clone().requires_grad_(True)) for r in routers
    ]
    x_TH = hidden_SBH.reshape(-1, H)
    terms = [
        reference_router_term(method, case, cfg.router_transform, W, b, W0, b0, x_TH, valid_T)
        for (W, b), (W0, b0) in zip(leaves, bases, strict=True)
    ]
    loss = coef * torch.stack(terms).mean()
    grads = torch.autograd.grad(loss, [t for pair in leaves for t in pair])
    return loss.detach(), grads


@pytest.mark.parametrize("case_name", list(LOSS_CASES))
@pytest.mark.parametrize("method", list(LOSS_CONFIGS))
def test_loss_term_and_its_gradients_against_reference(method, case_name):
    routers, hidden = build_routers(CASES[case_name]), make_hidden()
    bases = [(r.weight.detach().clone(), r.bias.detach().clone()) for r in routers]
    padding = torch.zeros(S, B, dtype=torch.bool)
    padding[4, 0] = True  # an A token of row 0 that Megatron's own padding mask drops
    if CASES[case_name].expert_bias:
        # megatron-core 0.16.1's expert-bias token count cannot take a padding mask ([T, E] & [T])
        padding = None
    handle = install_megatron_anchor(routers, loss_config(method, case_name))
    with drifted(routers), handle.step(SAMPLE_BS, SPAN_BS):
        outputs = forward(routers, hidden, padding)
        loss = handle.loss()
        loss.backward()
        expected, grads = reference_loss(method, case_name, routers, bases, hidden, valid_rows(SAMPLE_BS, padding))
        torch.testing.assert_close(loss.detach(), expected, rtol=1e-5, atol=1e-7)
        got = [p.grad for r in routers for p in (r.weight, r.bias)]
        for g, want in zip(got, grads, strict=True):
            torch.testing.assert_close(g, want, rtol=1e-4, atol=1e-7)
        assert any(float(g.abs().sum()) > 0 for g in got)
        # the routing itself stays Megatron's: the anchor only adds a loss term
        logits = [torch.nn.functional.linear(hidden, r.weight, r.bias).detach() for r in routers]
        for r, z, out in zip(routers, logits, outputs, strict=True):
            native = TopKRouter.routing(r, z, padding_mask=padding)
            assert torch.equal(out[1], native[1]) and torch.allclose(out[0], native[0])
    handle.remove()


@pytest.mark.parametrize("method", ["lbl", "kl-to-base", "logit-l2"])
def test_padding_is_excluded_and_structural_tokens_count(method):
    """As on the HF path: padding (sample -1) never counts; structural tokens do, like any non-padding token."""
    routers, hidden = build_routers(CASES["softmax"]), make_hidden()
    handle = install_megatron_anchor(routers, LOSS_CONFIGS[method])

    def loss_with(hidden_SBH):
        with drifted(routers), handle.step(SAMPLE_BS, SPAN_BS):
            forward(routers, hidden_SBH)
            return float(handle.loss().detach())

    base = loss_with(hidden)
    padded, structural = hidden.clone(), hidden.clone()
    padded[4:, 1] += 5.0  # row 1, positions 4-5: padding
    structural[0, :] += 5.0  # position 0 of both rows: structural, not padding
    assert loss_with(padded) == base
    assert loss_with(structural) != pytest.approx(base, rel=1e-3)
    handle.remove()


@pytest.mark.parametrize("method", list(LOSS_CONFIGS))
def test_eval_mode_and_no_context_add_nothing_and_removal_restores(method):
    routers, hidden = build_routers(CASES["sigmoid-bias-groups"]), make_hidden()
    native = forward(routers, hidden)
    handle = install_megatron_anchor(routers, LOSS_CONFIGS[method])
    assert all("routing" in vars(r) for r in routers)
    assert all(("gating" in vars(r)) == (method in ("kl-to-base", "logit-l2")) for r in routers)
    with drifted(routers):
        forward(routers, hidden)  # train mode, but no micro-batch context
        handle.set_micro_batch(SAMPLE_BS, SPAN_BS)
        assert float(handle.loss().detach()) == 0.0  # nothing ran under this context yet
        routers.eval()
        forward(routers, hidden)
        assert float(handle.loss().detach()) == 0.0 and not handle._context.cache
        routers.train()
        forward(routers, hidden)
        assert float(handle.loss().detach()) > 0.0
    handle.remove()
    assert all("routing" not in vars(r) and "gating" not in vars(r) for r in routers)
    assert all(hr.base_weight_EH is None for hr in handle.routers)
    handle.set_micro_batch(SAMPLE_BS, SPAN_BS)  # a removed handle records nothing
    for out, n in zip(forward(routers, hidden), native, strict=True):
        assert all(torch.equal(a, c) for a, c in zip(out, n, strict=True))
    assert float(handle.loss().detach()) == 0.0


def test_recomputation_records_the_first_forward_and_reentrant_recomputation_is_caught():
    routers, hidden = build_routers(CASES["softmax"]), make_hidden()
    handle = install_megatron_anchor(routers, LOSS_CONFIGS["kl-to-base"])

    def run(checkpoint):
        x = hidden.clone().requires_grad_(True)  # the hidden states of a model, which carry grad
        fn = lambda x: forward(routers, x)[0][0]  # noqa: E731
        probs = fn(x) if checkpoint is None else torch.utils.checkpoint.checkpoint(fn, x, use_reentrant=checkpoint)
        loss = handle.loss()
        (probs.sum() + loss).backward()  # non-reentrant: routing runs again in backward, records nothing twice
        return loss.detach(), routers[0].weight.grad.clone()

    with drifted(routers):
        with handle.step(SAMPLE_BS, SPAN_BS):
            plain = run(None)
        routers.zero_grad()
        with handle.step(SAMPLE_BS, SPAN_BS):
            recomputed = run(False)
        routers.zero_grad()
        with handle.step(SAMPLE_BS, SPAN_BS), pytest.raises(RuntimeError, match="without gradients"):
            run(True)  # reentrant: the first forward runs without grad, as Megatron's recomputation does
    torch.testing.assert_close(plain, recomputed, rtol=0, atol=0)
    handle.remove()


class _AllGatherOfEqualShares(torch.autograd.Function):
    """One TP rank's rows placed among the other ranks' (recorded) rows; backward is what Megatron's
    reduce-scatter hands this rank when every rank computed the same function of the gathered rows:
    tp times the gradient of its own rows."""

    @staticmethod
    def forward(ctx, x_TC, others: list, rank: int):
        ctx.rank, ctx.tp, ctx.rows = rank, len(others) + 1, x_TC.shape[0]
        return torch.cat([*others[:rank], x_TC, *others[rank:]])

    @staticmethod
    def backward(ctx, grad_TC):
        return grad_TC[ctx.rank * ctx.rows : (ctx.rank + 1) * ctx.rows] * ctx.tp, None, None


@pytest.mark.parametrize("method", list(LOSS_CONFIGS))
def test_sequence_parallel_shares_add_up_to_the_whole_term(method):
    """Two simulated TP ranks each route their sequence shard and return half the term; the shares
    and their router gradients (which Megatron sums over the TP group) add up to the unsplit ones."""
    routers = build_routers(CASES["sigmoid-bias-groups"])
    sample_BS = torch.tensor([[1, 1, 1, 1, 1, 1, 1, 1], [2, 2, 2, 2, 2, 2, -1, -1]])
    span_BS = torch.tensor([[-1, 0, 0, 0, -1, 1, 1, 1], [-1, 0, 0, 1, 1, 1, -1, -1]])
    hidden = make_hidden(seed=6, rows=2, positions=8)
    params = [p for r in routers for p in (r.weight, r.bias)]

    def run(rank=0, tp=1, gather=None):
        handle = install_megatron_anchor(
            routers, LOSS_CONFIGS[method], tp_rank=rank, tp_size=tp, sequence_parallel=tp > 1
        )
        handle.gather_rows = gather
        with drifted(routers), handle.step(sample_BS, span_BS):
            shard = 8 // tp
            forward(routers, hidden[rank * shard : (rank + 1) * shard])
            share = handle.loss()
            assert handle.loss_shares == tp
            grads = torch.autograd.grad(share, params)
        handle.remove()
        return share.detach(), grads

    whole, whole_grads = run()
    # pass 1 records what each rank hands the all-gather; pass 2 gathers those rows around the live ones
    sent = {0: [], 1: []}
    for rank in (0, 1):
        run(rank, 2, gather=lambda x, rank=rank: sent[rank].append(x.detach()) or torch.cat([x, x]))
    shares, grads = [], []
    for rank in (0, 1):
        calls = iter(range(len(sent[rank])))
        gather = lambda x, rank=rank, calls=calls: _AllGatherOfEqualShares.apply(  # noqa: E731
            x, [sent[1 - rank][next(calls)]], rank
        )
        share, g = run(rank, 2, gather)
        shares.append(share)
        grads.append(g)
    torch.testing.assert_close(shares[0], whole / 2, rtol=1e-5, atol=1e-7)
    torch.testing.assert_close(shares[0] + shares[1], whole, rtol=1e-5, atol=1e-7)
    for g0, g1, want in zip(*grads, whole_grads, strict=True):
        torch.testing.assert_close(g0 + g1, want, rtol=1e-4, atol=1e-7)


def test_router_freeze_stops_router_gradients_until_removed(caplog):
    routers, hidden = build_routers(CASES["softmax"]), make_hidden()
    with caplog.at_level("WARNING", logger="rpb.integrations.megatron.router"):
        handle = install_megatron_anchor(routers, AnchorConfig(method="router-freeze"))
    assert "router-freeze: 4 parameter(s) of 2 router(s) frozen" in caplog.text and handle.notes
    assert not any(p.requires_grad for p in routers.parameters())
    x = hidden.clone().requires_grad_(True)
    with handle.step(SAMPLE_BS, SPAN_BS):
        probs = forward(routers, x)[0][0]
        (probs * torch.arange(E)).sum().backward()
        assert float(handle.loss().detach()) == 0.0
    assert x.grad is not None and routers[0].weight.grad is None and routers[0].bias.grad is None
    handle.remove()
    assert all(p.requires_grad for p in routers.parameters())

    # freezing after Megatron's DDP gave the parameters gradient buffers is refused; before is the way
    routers[1].weight.main_grad = torch.zeros_like(routers[1].weight)
    with pytest.raises(MegatronAnchorError, match="already trainable in Megatron's DDP"):
        install_megatron_anchor(routers, AnchorConfig(method="router-freeze"))
    assert freeze_router_parameters(routers) is routers
    handle = install_megatron_anchor(routers, AnchorConfig(method="router-freeze"))
    assert "4 already were" in handle.notes[-1]
    handle.remove()
    assert not any(p.requires_grad for p in routers.parameters())  # restored to the pre-wrap state


def test_loss_anchors_refuse_native_aux_loss_and_reentrant_recomputation():
    routers = build_routers(CASES["softmax"])
    routers[0].routing_type, routers[0].config.moe_aux_loss_coeff = "aux_loss", 0.01
    with pytest.raises(MegatronAnchorError, match="native auxiliary loss"):
        install_megatron_anchor(routers, LOSS_CONFIGS["lbl"])
    routers = build_routers(CASES["softmax"])
    routers[0].config.recompute_granularity = "full"
    for method in ("lbl", "kl-to-base", "logit-l2"):
        with pytest.raises(MegatronAnchorError, match="reentrant"):
            install_megatron_anchor(routers, LOSS_CONFIGS[method])
    install_megatron_anchor(routers, LOSS_CONFIGS["router-l2"]).remove()  # computed from the weights


# ----------------------------------------------------------------------------- prior verification
def test_fingerprint_is_the_hf_one_on_the_same_weights():
    routers = build_routers(CASES["sigmoid-bias-groups"])
    handle = install_megatron_anchor(routers, AnchorConfig(method="sft"))
    h = hashlib.sha256()
    for r in routers:  # the HF adapter hashes gate weight, then e_score_correction_bias, as bfloat16
        for t in (r.weight, r.expert_bias):
            h.update(t.detach().to(torch.bfloat16).view(torch.int16).numpy().tobytes())
    assert megatron_routers_sha256(handle.routers) == h.hexdigest()
    handle.remove()


def run_facts(routers, routed_positions=ROUTED_ALL_POSITIONS, **changes):
    handle = install_megatron_anchor(routers, AnchorConfig(method="sft"))
    facts = megatron_run_facts(
        handle.routers, data_sha256="d" * 64, num_rows=NUM_PRIOR_ROWS, model="moonlight", tokenizer="moonlight",
        chat_template_sha256="c" * 64, max_seq_len=S, routed_positions=routed_positions,
    )  # fmt: skip
    handle.remove()
    meta = {
        "data_sha256": "d" * 64, "num_rows": NUM_PRIOR_ROWS, "model": "moonlight", "tokenizer": "moonlight",
        "routers_sha256": facts.routers_sha256, "chat_template_sha256": "c" * 64, "top_k": CASES["softmax"].topk,
        "max_seq_len": S, "routed_positions": ROUTED_ALL_POSITIONS, "moe_layers": [1, 2], "num_experts": E,
    }  # fmt: skip
    meta.update(changes)
    return meta, facts


def test_verify_checks_the_hf_fields_and_reconciles_routed_positions():
    routers = build_routers(CASES["softmax"])
    meta, facts = run_facts(routers)
    assert verify_megatron_prior(meta, facts, rows=[]) is None
    assert facts.moe_layers == [1, 2]  # megatron layer numbers 2, 3 are HF decoder layers 1, 2

    meta, facts = run_facts(routers, ROUTED_ALL_BUT_LAST)
    ends_structural = [(0, [-1, 0, 1, -1]), (1, [-1, 1, -1])]
    assert "reconciled" in verify_megatron_prior(meta, facts, ends_structural)
    with pytest.raises(PriorMismatchError, match=r"routed_positions.*rows 1"):
        verify_megatron_prior(meta, facts, [(0, [-1, 0, 1, -1]), (1, [-1, 0, 1, 1])])

    meta, facts = run_facts(routers, top_k=6, moe_layers=[1, 2, 3], num_experts=64, routers_sha256="0" * 64)
    with pytest.raises(PriorMismatchError) as err:
        verify_megatron_prior(meta, facts, rows=[])
    fields = [m[0] for m in err.value.mismatches]
    assert fields == ["model", "routers_sha256", "top_k", "moe_layers", "num_experts"]
