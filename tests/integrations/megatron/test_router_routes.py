"""routing-kd from stored routes on megatron-core's ``TopKRouter`` (the CPU contract): the base's top-k per token
handed in with the micro-batch, laid out as the router's rows (position-major), and the term read against a plain
torch computation on the router's own logits; the online base and output-kd refused at install, by name."""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("megatron.core", reason="megatron-core is an optional extra: pip install 'rpb[megatron]'")

from rpb.anchors import AnchorConfig
from rpb.integrations.megatron import MegatronAnchorError, install_megatron_anchor
from tests.integrations.megatron.routers import CASES, SAMPLE_BS, SPAN_BS, B, E, S, build_routers
from tests.integrations.megatron.test_router_losses import drifted, forward, make_hidden, valid_rows

LAMBDA = 0.7


def base_routes(K: int, layers: int, seed: int = 8):
    gen = torch.Generator().manual_seed(seed)
    ids = torch.stack([torch.randperm(E, generator=gen)[:K] for _ in range(B * S * layers)]).reshape(B, S, layers, K)
    probs = torch.rand(B, S, layers, K, generator=gen) + 0.05
    return ids, 0.9 * probs / probs.sum(-1, keepdim=True)  # probabilities of a distribution: 0.1 left for the rest


@pytest.mark.parametrize(("with_probs", "form"), [(False, None), (True, "topk-kl"), (True, None)])
@pytest.mark.parametrize("case_name", ["softmax", "sigmoid-bias-groups"])
def test_the_stored_routes_term_is_the_hand_one_in_router_row_order(case_name, with_probs, form):
    """Ids alone: the set cross-entropy; probabilities renormalised over the k (topk-kl); the default with
    probabilities, the bucket (the k stored cells as they are, and one for the rest)."""
    case = CASES[case_name]
    routers, hidden = build_routers(case), make_hidden()
    ids_BSLK, probs_BSLK = base_routes(case.topk, len(routers))
    handle = install_megatron_anchor(routers, AnchorConfig(method="routing-kd", lambda_=LAMBDA, base="routes",
                                                           routes="stored.safetensors", routes_loss=form))  # fmt: skip
    with drifted(routers), handle.step(SAMPLE_BS, SPAN_BS, ids_BSLK, probs_BSLK if with_probs else None) as ctx:
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
                    if with_probs and form is None:
                        q = probs_BSLK[b, s, pos].double()
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
