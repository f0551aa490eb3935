"""The ``router_replay`` hook beside megatron-core's own ``RouterReplay``, on CPU: the loss anchors' terms
read the live logits while a replay fixes the experts; a selection anchor refuses an active replay and
gives the router its own replay object back; ``megatron_select`` is the live router's choice.

A ``RouterReplay`` is attached as ``TopKRouter.__init__`` attaches it under ``moe_enable_routing_replay``
(megatron-core 0.16.1 router.py:205-207), after the anchor is installed."""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("megatron.core", reason="megatron-core is an optional extra: pip install 'rpb[megatron]'")

from megatron.core.transformer.moe.router_replay import RouterReplay, RouterReplayAction

from rpb.anchors import AnchorConfig
from rpb.integrations.megatron import install_megatron_anchor, megatron_select
from rpb.integrations.megatron.topk_hook import forced_topk, replay_action
from tests.integrations.megatron.routers import (
    CASES,
    SAMPLE_BS,
    SPAN_BS,
    B,
    E,
    S,
    build_routers,
    check_against_reference,
    make_logits,
    make_prior,
    reference,
    sigmoid_of,
    softmax_of,
)
from tests.integrations.megatron.test_router_losses import (
    LOSS_CASES,
    LOSS_CONFIGS,
    drifted,
    forward,
    loss_config,
    make_hidden,
    reference_loss,
    valid_rows,
)


@pytest.fixture
def attach_replay():
    """Gives routers a RouterReplay each; takes them out of megatron's global list afterwards."""
    made = []

    def attach(routers, action=None):
        for r in routers:
            r.router_replay = RouterReplay()
            if action is not None:
                r.router_replay.set_router_replay_action(action)
            made.append(r.router_replay)
        return [r.router_replay for r in routers]

    yield attach
    for replay in made:
        RouterReplay.global_router_replay_instances.remove(replay)


def bottom_k(z_TE: torch.Tensor, k: int) -> torch.Tensor:
    """The k lowest logits of each row: experts the live router never picks (no group limit, no bias)."""
    return torch.argsort(z_TE, dim=-1)[:, :k]


def weights_at(case, z: list[float], ids: list[int]) -> dict[int, float]:
    """Megatron's combine weights of the experts ``ids`` from the logits ``z`` (routers.reference's rule)."""
    if case.score == "sigmoid":
        s = {e: sigmoid_of(z[e]) for e in ids}
        w = {e: v / (sum(s.values()) + 1e-20) for e, v in s.items()}
    elif case.pre_softmax:
        w = {e: softmax_of(z)[e] for e in ids}
    else:
        w = dict(zip(ids, softmax_of([z[e] for e in ids]), strict=True))
    return {e: v * (case.scaling or 1.0) for e, v in w.items()}


@pytest.mark.parametrize("case_name", list(LOSS_CASES))
@pytest.mark.parametrize("method", list(LOSS_CONFIGS))
def test_loss_terms_read_the_live_logits_while_replay_fixes_the_experts(method, case_name, attach_replay):
    case = CASES[case_name]
    routers, hidden = build_routers(case), make_hidden()
    bases = [(r.weight.detach().clone(), r.bias.detach().clone()) for r in routers]
    handle = install_megatron_anchor(routers, loss_config(method, case_name))
    replays = attach_replay(routers, RouterReplayAction.REPLAY_FORWARD)
    with drifted(routers), handle.step(SAMPLE_BS, SPAN_BS):
        live = [torch.nn.functional.linear(hidden, r.weight, r.bias).detach().reshape(-1, E) for r in routers]
        replayed = [bottom_k(z_TE, case.topk) for z_TE in live]
        for replay, ids_TK in zip(replays, replayed, strict=True):
            replay.set_target_indices(ids_TK)
        outputs = forward(routers, hidden)
        for z_TE, ids_TK, (probs_TE, map_TE) in zip(live, replayed, outputs, strict=True):
            probs_TE = probs_TE.detach()
            for t in range(S * B):
                ids = sorted(ids_TK[t].tolist())
                assert ids != reference(case, z_TE[t].tolist(), [0.0] * E, None)[0]  # not the live choice
                assert map_TE[t].nonzero().flatten().tolist() == ids  # the replay chose
                want = weights_at(case, z_TE[t].tolist(), ids)  # the gates: the live logits at those ids
                for e in range(E):
                    assert float(probs_TE[t, e]) == pytest.approx(want.get(e, 0.0), abs=1e-6)
        # the language-model path still trains the router through the replayed gates
        gates = sum((probs_TE * torch.arange(E)).sum() for probs_TE, _ in outputs)
        assert float(torch.autograd.grad(gates, routers[0].weight, retain_graph=True)[0].abs().sum()) > 0
        loss = handle.loss()
        loss.backward()
        # the term is the HF one on the live logits (lbl: the load of the live top-k, not of the replayed ids)
        expected, grads = reference_loss(method, case_name, routers, bases, hidden, valid_rows(SAMPLE_BS))
        torch.testing.assert_close(loss.detach(), expected, rtol=1e-5, atol=1e-7)
        for p, want in zip([p for r in routers for p in (r.weight, r.bias)], grads, strict=True):
            torch.testing.assert_close(p.grad, want, rtol=1e-4, atol=1e-7)
    handle.remove()
    assert all(r.router_replay is replay for r, replay in zip(routers, replays, strict=True))


def test_a_recording_replay_records_megatrons_own_choice_under_a_loss_anchor(attach_replay):
    case = CASES["sigmoid-bias-groups"]
    routers, hidden = build_routers(case), make_hidden()
    handle = install_megatron_anchor(routers, LOSS_CONFIGS["kl-to-base"])
    replays = attach_replay(routers, RouterReplayAction.RECORD)
    with handle.step(SAMPLE_BS, SPAN_BS):
        forward(routers, hidden)
    for r, replay in zip(routers, replays, strict=True):
        z_TE = torch.nn.functional.linear(hidden, r.weight, r.bias).detach().reshape(-1, E)
        eb = r.expert_bias.tolist()
        for t in range(S * B):
            ids = reference(case, z_TE[t].tolist(), [0.0] * E, eb)[0]
            assert sorted(replay.get_recorded_indices()[t].tolist()) == ids
    handle.remove()


@pytest.mark.parametrize("action", [RouterReplayAction.REPLAY_FORWARD, RouterReplayAction.RECORD])
def test_a_selection_anchor_refuses_an_active_replay_at_run_time(action, attach_replay):
    case = CASES["softmax"]
    routers, pi, logits = build_routers(case), make_prior(), make_logits()
    handle = install_megatron_anchor(routers, AnchorConfig(method="rpb"), prior=pi)
    replays = attach_replay(routers, action)
    replays[0].set_target_indices(bottom_k(logits.reshape(-1, E), case.topk))
    handle.set_micro_batch(SAMPLE_BS, SPAN_BS)
    with pytest.raises(RuntimeError, match=r"routing replay is active .*override its biased selection"):
        routers[0].routing(logits.clone())
    assert routers[0].router_replay is replays[0] and replays[0].get_recorded_indices() is None
    handle.remove()


def test_an_idle_replay_lets_the_selection_anchor_run_and_is_given_back(attach_replay):
    """A RouterReplay with no action routes natively; the anchor's biased choice runs and the router keeps
    its replay object (an earlier version left ``router_replay`` None after each call)."""
    case = CASES["sigmoid-bias-groups"]
    routers, pi, logits = build_routers(case), make_prior(), make_logits()
    handle = install_megatron_anchor(routers, AnchorConfig(method="rpb", beta=1.0), prior=pi)
    replays = attach_replay(routers)
    handle.set_micro_batch(SAMPLE_BS, SPAN_BS)
    check_against_reference(case, routers, logits, pi)
    assert all(r.router_replay is replay for r, replay in zip(routers, replays, strict=True))
    handle.remove()


def test_forced_topk_puts_the_routers_own_object_back_even_on_error(attach_replay):
    router = build_routers(CASES["softmax"])[0]
    (own,) = attach_replay([router])
    ids_TK = torch.zeros(3, 2, dtype=torch.long)
    with pytest.raises(ValueError), forced_topk(router, ids_TK, "router x"):
        assert router.router_replay is not own and router.router_replay.ids_TK is ids_TK
        raise ValueError
    assert router.router_replay is own and replay_action(router) is None
    own.set_router_replay_action(RouterReplayAction.REPLAY_BACKWARD)
    assert replay_action(router) is RouterReplayAction.REPLAY_BACKWARD
    with (
        pytest.raises(RuntimeError, match="router x: Megatron's routing replay is active"),
        forced_topk(router, ids_TK, "router x"),
    ):
        pass
    assert router.router_replay is own
    router.router_replay = None  # moe_enable_routing_replay=False
    assert replay_action(router) is None


@pytest.mark.parametrize("name", list(CASES))
def test_megatron_select_is_the_live_choice_whatever_a_replay_dispatches(name, attach_replay):
    case = CASES[name]
    router = build_routers(case)[0]
    (replay,) = attach_replay([router], RouterReplayAction.REPLAY_FORWARD)
    logits_TE = make_logits().reshape(-1, E)
    replay.set_target_indices(bottom_k(logits_TE, case.topk))
    chosen_TK = megatron_select(router, logits_TE)
    eb = router.expert_bias.tolist() if router.expert_bias is not None else None
    for t in range(logits_TE.shape[0]):
        assert sorted(chosen_TK[t].tolist()) == reference(case, logits_TE[t].tolist(), [0.0] * E, eb)[0]
