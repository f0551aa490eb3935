"""The loss-based anchors and router-freeze on megatron-core's ``TopKRouter``: the whole router
``forward`` on hidden states; references are the HF path's definitions as plain torch formulas on
leaf copies of the weights."""

from __future__ import annotations

import contextlib
import dataclasses

import pytest
import torch

pytest.importorskip("megatron.core", reason="megatron-core is an optional extra: pip install 'rpb[megatron]'")

from megatron.core.transformer.moe.router import TopKRouter

from rpb.anchors import AnchorConfig
from rpb.integrations.megatron import (
    MegatronAnchorError,
    freeze_router_parameters,
    install_megatron_anchor,
)
from tests.integrations.megatron.routers import (
    CASES,
    SAMPLE_BS,
    SPAN_BS,
    B,
    E,
    H,
    S,
    buffers_on_cpu,
    build_routers,
    make_prior,
)

# ----------------------------------------------------------------------------- loss-based anchors
LOSS_CONFIGS = {
    "lbl": AnchorConfig(method="lbl", lbl_coef=0.3),
    "router-l2": AnchorConfig(method="router-l2", lambda_=0.7),
    "kl-to-base": AnchorConfig(method="kl-to-base", lambda_=0.7),
    "logit-l2": AnchorConfig(method="logit-l2", lambda_=0.7),
}
#: a softmax router, and a sigmoid one, kl-to-base with no transform set: each reads its family's own
#: (softmax; the normalised sigmoid), as the HF path does without a prior
LOSS_CASES = {"softmax": None, "sigmoid-bias-groups": None}


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
        transform = transform or ("sigmoid-normalized" if case.score == "sigmoid" else "softmax")
        p_TE, pb_TE = dist(z_TE, transform), dist(zb_TE, transform)
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


def test_a_method_registered_in_the_table_runs_on_megatron_routers():
    """A loss anchor that exists only in a test fixture (its entry and its math) reaches Megatron's
    routers through the methods table alone: coef x mean over routers of its term, each by hand on
    the logits ``x W^T + b`` of the valid rows."""
    from tests.anchors import dummy_method

    routers, hidden = build_routers(CASES["softmax"]), make_hidden()
    with dummy_method.registered():
        handle = install_megatron_anchor(routers, AnchorConfig(method=dummy_method.NAME, lambda_=0.3))
        with drifted(routers), handle.step(SAMPLE_BS, SPAN_BS):
            forward(routers, hidden)
            term = handle.loss()
            x_TH, valid_T = hidden.reshape(-1, H), valid_rows(SAMPLE_BS)
            logits = [(x_TH @ r.weight.T + r.bias).detach() for r in routers]
            expected = 0.3 * sum(dummy_method.by_hand(z, valid_T) for z in logits) / len(routers)
        handle.remove()
    assert float(term) == pytest.approx(expected, rel=1e-5)
    assert term.requires_grad


@pytest.mark.parametrize("method", ["rpb", "kl-to-base"])
def test_routing_figures_for_bridge_are_the_counts_by_hand(method):
    """report(): [numerator, denominator] per layer with the HF path's names, counted by hand here."""
    case = CASES["softmax"]
    routers, hidden = build_routers(case), make_hidden()
    prior = make_prior()
    cfg = AnchorConfig(method="rpb", beta=2.0) if method == "rpb" else LOSS_CONFIGS["kl-to-base"]
    handle = install_megatron_anchor(routers, cfg, prior=prior if method == "rpb" else None)
    bases = [(r.weight.detach().clone(), None if r.bias is None else r.bias.detach().clone()) for r in routers]
    valid = valid_rows(SAMPLE_BS)
    content = valid & (SPAN_BS.T.reshape(-1) >= 0)
    with drifted(routers), handle.step(SAMPLE_BS, SPAN_BS):
        outputs = forward(routers, hidden)
        report = handle.report()
        drift = [torch.nn.functional.linear(hidden, r.weight, r.bias).reshape(-1, E).topk(case.topk, -1).indices
                 for r in routers]  # fmt: skip
    for r, out, now, base in zip(routers, outputs, drift, bases, strict=True):
        name = f"moe/layer_{r.layer_number - 1}"
        chosen = [frozenset(torch.nonzero(row).flatten().tolist()) for row in out[1]]
        if method == "rpb":
            own = [frozenset(x) for x in now.tolist()]
            changed = sum(1 for t in range(len(own)) if content[t] and chosen[t] != own[t])
            assert report[f"{name}/bias_changed_fraction"].tolist() == [changed, int(content.sum())]
            assert changed > 0
        else:
            then = torch.nn.functional.linear(hidden, *base).reshape(-1, E).topk(case.topk, -1).indices
            shared = sum(len(set(a) & set(b)) for a, b, v in zip(now.tolist(), then.tolist(), valid, strict=True) if v)
            assert report[f"{name}/base_topk_overlap_current_hidden"].tolist() == [shared, int(valid.sum()) * case.topk]
            assert f"{name}/anchor_loss" in report and "moe/mean/anchor_loss" in report
    handle.remove()
