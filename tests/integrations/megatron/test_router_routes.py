"""routing-kd from stored routes on megatron-core's ``TopKRouter`` (the CPU contract): the base's top-k per token
handed in with the micro-batch, laid out as the router's rows (position-major), and the term read against a plain
torch computation on the router's own logits; the online base and output-kd refused at install, by name."""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("megatron.core", reason="megatron-core is an optional extra: pip install 'rpb[megatron]'")

from rpb.anchors import AnchorConfig
from rpb.integrations.megatron import MegatronAnchorError, install_megatron_anchor
from tests.integrations.megatron.routers import CASES, SAMPLE_BS, SPAN_BS, B, E, S, buffers_on_cpu, build_routers
from tests.integrations.megatron.test_router_losses import drifted, forward, make_hidden, valid_rows

LAMBDA = 0.7


def base_routes(K: int, layers: int, seed: int = 8):
    gen = torch.Generator().manual_seed(seed)
    ids = torch.stack([torch.randperm(E, generator=gen)[:K] for _ in range(B * S * layers)]).reshape(B, S, layers, K)
    probs = torch.rand(B, S, layers, K, generator=gen) + 0.05
    return ids, 0.9 * probs / probs.sum(-1, keepdim=True)  # probabilities of a distribution: 0.1 left for the rest


@pytest.mark.parametrize(("with_probs", "form", "extra"),
                         [(False, "set-ce", 0), (True, "topk-kl", 0), (True, None, 0), (True, None, 2)])  # fmt: skip
@pytest.mark.parametrize("case_name", ["softmax", "sigmoid-bias-groups"])
def test_the_stored_routes_term_is_the_hand_one_in_router_row_order(case_name, with_probs, form, extra):
    """Ids alone: the set cross-entropy; probabilities renormalised over the k (topk-kl); the default with
    probabilities, the bucket (the k stored cells as they are, and one for the rest), also over a ``--top-m``
    file's ``extra`` experts beyond the k."""
    case = CASES[case_name]
    routers, hidden = build_routers(case), make_hidden()
    ids_BSLM, probs_BSLM = base_routes(case.topk + extra, len(routers))
    ids_BSLK, probs_BSLK = ids_BSLM[..., : case.topk], probs_BSLM[..., : case.topk]
    more = (ids_BSLM[..., case.topk :], probs_BSLM[..., case.topk :]) if extra else None
    handle = install_megatron_anchor(routers, AnchorConfig(method="routing-kd", lambda_=LAMBDA, base="routes",
                                                           routes="stored.safetensors", routes_loss=form))  # fmt: skip
    step = handle.step(SAMPLE_BS, SPAN_BS, ids_BSLK, probs_BSLK if with_probs else None, more)
    with drifted(routers), step as ctx:
        forward(routers, hidden)
        loss = handle.loss()
        valid = valid_rows(SAMPLE_BS)
        terms = []
        for pos, r in enumerate(routers):
            z_SBE = torch.nn.functional.linear(hidden, r.weight, r.bias).detach().double()
            p = torch.softmax(z_SBE, -1) if case.score == "softmax" else torch.sigmoid(z_SBE) / torch.sigmoid(
                z_SBE).sum(-1, keepdim=True)  # fmt: skip
            per_row = []
            for s in range(S):  # router row t = s * B + b
                for b in range(B):
                    log_p = p[s, b, ids_BSLK[b, s, pos]].log()
                    if with_probs and form is None:  # the bucket over every stored expert, the extra ones too
                        log_p = p[s, b, ids_BSLM[b, s, pos]].log()
                        q = probs_BSLM[b, s, pos].double()
                        q_rest, p_rest = 1 - q.sum(), 1 - log_p.exp().sum()
                        per_row.append((q * (q.log() - log_p)).sum() + q_rest * (q_rest.log() - p_rest.log()))
                    elif with_probs:
                        q = probs_BSLK[b, s, pos].double() / probs_BSLK[b, s, pos].double().sum()
                        per_row.append((q * (q.log() - log_p)).sum())
                    else:
                        per_row.append(-log_p.mean())
            terms.append(torch.stack(per_row)[valid].mean())
        assert ctx.base.ids_LTK.shape == (len(routers), B * S, case.topk)
    assert float(loss.detach()) == pytest.approx(LAMBDA * float(torch.stack(terms).mean()), rel=1e-5)
    handle.remove()


def test_the_online_base_and_output_kd_are_refused_on_megatron_and_routes_are_asked_for():
    routers = build_routers(CASES["softmax"])
    with pytest.raises(MegatronAnchorError, match=r"the online base .* is not built here"):
        install_megatron_anchor(routers, AnchorConfig(method="routing-kd", lambda_=1.0))
    with pytest.raises(MegatronAnchorError, match="does not run"):
        install_megatron_anchor(routers, AnchorConfig(method="output-kd", lambda_=1.0))
    handle = install_megatron_anchor(routers, AnchorConfig(method="routing-kd", lambda_=1.0, base="routes",
                                                           routes="stored.safetensors"))  # fmt: skip
    with pytest.raises(RuntimeError, match="pass base_ids_BSLK"):
        handle.set_micro_batch(SAMPLE_BS, SPAN_BS)
    handle.remove()
    with pytest.raises(MegatronAnchorError, match="routing-kd-router on Megatron-Core: a control of why"):
        install_megatron_anchor(routers, AnchorConfig(method="routing-kd-router", lambda_=1.0, base="routes",
                                                      routes="stored.safetensors"))  # fmt: skip


def hand_hinge(s_E: list[float], base: set[int], groups: int, group_topk: int) -> float:
    """The ids-alone hinge of one row, from its definition (docs/methods.md), on Python floats: groups scored by
    their top-2 sum, the rivals those of the groups the rule keeps, the base's weakest group against the group
    that would be kept in its place."""
    per = len(s_E) // groups
    score = [sum(sorted(s_E[j * per : (j + 1) * per])[-2:]) for j in range(groups)]
    kept = sorted(range(groups), key=lambda j: -score[j])[:group_topk]
    rivals = [e for e in range(len(s_E)) if e not in base and e // per in kept]
    term = max(0.0, max(s_E[e] for e in rivals) - min(s_E[e] for e in base)) if rivals else 0.0
    mine = {e // per for e in base}
    others = sorted((score[j] for j in range(groups) if j not in mine), reverse=True)
    at = min(max(group_topk - len(mine), 0), len(others) - 1)
    return term + max(0.0, others[at] - min(score[j] for j in mine)) if others else term


@pytest.mark.parametrize("case_name", ["softmax", "sigmoid-bias-groups"])
def test_the_ids_alone_hinge_is_the_hand_one_in_router_row_order_and_its_active_rows_are_reported(case_name):
    """The base's ids are the routers' own choice before the drift (each router's routing map), so the hinge is 0
    there and, drifted, the hand margin of each row (in row order: t = s * B + b) on the rule's scores."""
    case = CASES[case_name]
    routers, hidden = build_routers(case), make_hidden()
    with buffers_on_cpu():
        maps = [r(hidden)[1].reshape(S, B, E) for r in routers]  # routing_map [T, E], rows position-major
    ids_BSLK = torch.stack([m.transpose(0, 1).float().topk(case.topk, -1).indices for m in maps], 2)
    config = AnchorConfig(method="routing-kd", lambda_=LAMBDA, base="routes", routes="ids.safetensors")
    handle = install_megatron_anchor(routers, config)  # ids alone: the hinge by default
    valid = valid_rows(SAMPLE_BS)
    with handle.step(SAMPLE_BS, SPAN_BS, ids_BSLK):
        forward(routers, hidden)
        assert float(handle.loss().detach()) == 0.0
    with drifted(routers), handle.step(SAMPLE_BS, SPAN_BS, ids_BSLK):
        forward(routers, hidden)
        loss, report = handle.loss(), handle.report()
        terms, actives = [], []
        for pos, r in enumerate(routers):
            z_SBE = torch.nn.functional.linear(hidden, r.weight, r.bias).detach().double()
            s_SBE = z_SBE if case.score == "softmax" else torch.sigmoid(z_SBE) + r.expert_bias.double()
            per_row = [hand_hinge(s_SBE[s, b].tolist(), set(ids_BSLK[b, s, pos].tolist()), case.num_groups or 1,
                                  case.group_topk or 1) for s in range(S) for b in range(B)]  # fmt: skip
            per_row = torch.tensor(per_row)[valid]
            terms.append(per_row.mean())
            actives.append(int((per_row > 0).sum()))
            pair = report[f"moe/layer_{r.layer_number - 1}/routes_hinge_active"]
            assert pair.tolist() == [actives[-1], int(valid.sum())]
    assert sum(actives) > 0, "the drift should lose some of the base's sets"
    assert float(loss.detach()) == pytest.approx(LAMBDA * float(torch.stack(terms).mean()), rel=1e-5)
    handle.remove()
    grouped = build_routers(CASES["softmax-pre-groups"])
    refused = install_megatron_anchor(grouped, config)
    ids_BSLK = torch.stack([torch.arange(4).expand(B, S, 4)] * len(grouped), 2)
    with (
        pytest.raises(ValueError, match="top2-sum over softmax scores rank otherwise"),
        refused.step(SAMPLE_BS, SPAN_BS, ids_BSLK),
    ):
        forward(grouped, hidden)
    refused.remove()
