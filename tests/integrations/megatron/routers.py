"""Shared by the Megatron-Core tests: tiny ``TopKRouter`` stacks on CPU, priors, logits, and
references written from megatron-core's routing semantics on Python floats (they never call
megatron or ``rpb``); the eq. 3 bias by hand in float64.

Routers are built with ``use_cpu_initialization=True`` and a ``ProcessGroupCollection``; their
expert-bias buffers, which ``__init__`` allocates on ``torch.cuda.current_device()``, are built
on CPU here. A one-process gloo group (``conftest.py``) serves them.

Shape legend: B micro-batch rows, S positions, T router rows (position * B + row), E experts,
H hidden size, K top-k.
"""

from __future__ import annotations

import contextlib
import math
from dataclasses import dataclass

import pytest
import torch

pytest.importorskip("megatron.core", reason="megatron-core is an optional extra: pip install 'rpb[megatron]'")

from megatron.core.process_groups_config import ProcessGroupCollection
from megatron.core.transformer.moe.router import TopKRouter
from megatron.core.transformer.transformer_config import TransformerConfig

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
    # the router weights come from the global generator: seed it, so that a test's routers do not
    # depend on which tests ran before it
    with buffers_on_cpu(), torch.random.fork_rng():
        torch.manual_seed(seed)
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
def top_choice(values: list[float], candidates: list[int], k: int) -> list[int]:
    ranked = sorted(candidates, key=lambda e: -values[e])
    if len(ranked) > k:
        assert values[ranked[k - 1]] - values[ranked[k]] > 1e-5, "near-tie at the top-k cut: choose another seed"
    return sorted(ranked[:k])


def softmax_of(values: list[float]) -> list[float]:
    m = max(values)
    ex = [math.exp(v - m) for v in values]
    return [v / sum(ex) for v in ex]


def sigmoid_of(v: float) -> float:
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
        choice = [sigmoid_of(v) + (expert_bias[e] if expert_bias else 0.0) for e, v in enumerate(zb)]
    else:
        choice = softmax_of(zb) if case.pre_softmax else zb
    candidates = list(range(E))
    if case.group_topk:
        per = E // case.num_groups
        group_value = [
            sum(sorted(choice[g * per : (g + 1) * per], reverse=True)[: case.topk // case.group_topk])
            for g in range(case.num_groups)
        ]
        kept = top_choice(group_value, list(range(case.num_groups)), case.group_topk)
        candidates = [e for g in kept for e in range(g * per, (g + 1) * per)]
    ids = top_choice(choice, candidates, case.topk)
    if case.score == "sigmoid":
        s = {e: sigmoid_of(z[e]) for e in ids}
        weights = {e: v / (sum(s.values()) + 1e-20) for e, v in s.items()}
    elif case.pre_softmax:
        full = softmax_of(z)
        weights = {e: full[e] for e in ids}
    else:
        weights = dict(zip(ids, softmax_of([z[e] for e in ids]), strict=True))
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
