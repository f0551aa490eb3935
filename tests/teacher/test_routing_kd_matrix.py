"""``routing-kd`` on every real-config replica (``rpb.testing.REPLICAS``), read against a hand computation: the base
and the training model run as two separate forwards, each router's output read by hooks of the test's own, and
the term written out from its definition (KL of the family's transform; the stored routes' set cross-entropy and
top-k KL) in float64."""

from __future__ import annotations

import pytest
import torch

from rpb.adapters import find_moe_layers, get_adapter, routers_sha256
from rpb.anchors import AnchorConfig, install_anchor
from rpb.collect.hf_routes import write_routes
from rpb.data import load_labelled
from rpb.models import load_causal_lm, load_tokenizer
from rpb.replay.routefile import load_routes
from rpb.teacher import load_stored_routes, online_base
from rpb.testing.data import conversations, write_jsonl
from rpb.testing.replicas import REPLICAS, published, routing_part
from tests.project.test_family_matrix import MAX_LEN, batch_of

pytestmark = pytest.mark.usefixtures("one_thread")
LAMBDA = 0.5


def probs(z_TE: torch.Tensor, sigmoid: bool) -> torch.Tensor:
    z = z_TE.double()
    if sigmoid:
        s = torch.sigmoid(z)
        return s / s.sum(-1, keepdim=True)
    return torch.softmax(z, -1)


def router_outputs(model, facts, batch) -> list[tuple]:
    """Each MoE layer's router output ``(logits, ..., ids)`` of one forward of ``model`` on ``batch``."""
    seen = {}
    layers = find_moe_layers(model, facts)
    hooks = [m.router.register_forward_hook(lambda mod, a, out, p=p: seen.__setitem__(p, out))
             for p, m in enumerate(layers)]  # fmt: skip
    keys = ("input_ids", "attention_mask")
    try:
        model(**{k: batch[k] for k in keys})
    finally:
        for h in hooks:
            h.remove()
    return [seen[p] for p in range(len(layers))]


def move(model, facts, seed: int = 3) -> None:
    """A known drift: the attention projections and the routers moved by about a third of their own scale."""
    gen = torch.Generator().manual_seed(seed)
    routers = {id(m.router.weight) for m in find_moe_layers(model, facts)}
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "self_attn" in name or id(p) in routers:
                p.add_(torch.randn(p.shape, generator=gen) * 0.3 * p.float().std().clamp_min(1e-3))


@pytest.fixture(scope="module")
def family(replica, tmp_path_factory):
    cache = {}

    def make(name):
        if name not in cache:
            tmp = tmp_path_factory.mktemp(f"kd-{name}")
            cache[name] = replica(name), write_jsonl(conversations(4, seed=5), tmp / "train.jsonl"), tmp
        return cache[name]

    return make


@pytest.mark.parametrize("name", REPLICAS)
def test_online_routing_kd_is_the_hand_kl_between_two_forwards(name, family):
    model_dir, data, _ = family(name)
    model = load_causal_lm(str(model_dir)).train()
    facts = get_adapter(model.config.model_type)
    handle = install_anchor(model, AnchorConfig(method="routing-kd", lambda_=LAMBDA))
    handle.teacher = online_base(model, facts, model_id=str(model_dir), dtype=None, outputs=False)
    move(model, facts)  # after the base is taken: the base stays the checkpoint's
    batch = batch_of(model_dir, data)
    base = load_causal_lm(str(model_dir)).eval()
    with torch.no_grad():
        base_out = router_outputs(base, facts, batch)
    seen = {}
    layers = handle.layers
    hooks = [m.moe.router.register_forward_hook(lambda mod, a, out, p=p: seen.__setitem__(p, out))
             for p, m in enumerate(layers)]  # fmt: skip
    with handle.step(batch["rpb_sample_index"], batch["rpb_span"], batch["attention_mask"]) as ctx:
        ctx.base = handle.base_routing(batch, batch["rpb_sample_index"])
        model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"])
        term = handle.loss()
        term.backward()
    for h in hooks:
        h.remove()
    valid_T = batch["attention_mask"].reshape(-1).bool()
    sigmoid = facts.score_function == "sigmoid"
    per_layer = []
    for pos in range(len(layers)):
        q, p = probs(base_out[pos][0], sigmoid)[valid_T], probs(seen[pos][0].detach(), sigmoid)[valid_T]
        per_layer.append((q * (q.log() - p.log())).sum(-1).mean())
    hand = LAMBDA * torch.stack(per_layer).mean()
    assert float(hand) > 1e-4, f"{name}: the drift should move the routing"
    assert float(term.detach()) == pytest.approx(float(hand), rel=1e-4)
    # the gradient reaches what sits below the routers, not the routers alone
    grads = {n: p.grad for n, p in model.named_parameters() if "self_attn" in n and p.grad is not None}
    assert grads and any(float(g.abs().sum()) > 0 for g in grads.values()), f"{name}: no gradient below the routers"
    handle.remove()


@pytest.mark.parametrize("name", REPLICAS)
def test_stored_routing_kd_is_the_hand_set_cross_entropy_and_top_k_kl(name, family):
    model_dir, data, tmp = family(name)
    top_k = routing_part(published(name))["num_experts_per_tok"]
    model = load_causal_lm(str(model_dir)).train()
    facts = get_adapter(model.config.model_type)
    layers = find_moe_layers(model, facts)
    labelled = load_labelled(str(data), load_tokenizer(str(model_dir)), MAX_LEN)
    batch = batch_of(model_dir, data)
    base = load_causal_lm(str(model_dir)).eval()
    with torch.no_grad():
        base_out = router_outputs(base, facts, batch)
    fingerprint = routers_sha256(layers, facts)  # the base's: the route file is checked against it
    move(model, facts)
    handle = install_anchor(model, AnchorConfig(method="routing-kd", lambda_=LAMBDA, base="routes", routes="x"))
    sigmoid = facts.score_function == "sigmoid"
    valid_T = batch["attention_mask"].reshape(-1).bool()
    # ids alone (the set cross-entropy, by name: the hinge, the default there, has its own test below), the
    # probabilities renormalised over the k (topk-kl), and with the bucket (the default where probabilities are
    # stored), from a plain --with-probs file and from a --top-m k one (extra tensors with no columns)
    for with_probs, form, top_m in ((False, "set-ce", None), (True, "topk-kl", None), (True, None, None),
                                    (True, None, top_k)):  # fmt: skip
        handle.config.routes_loss = form
        path = tmp / f"routes-{with_probs}{'' if top_m is None else f'-top{top_m}'}.safetensors"
        if not path.is_file():
            transform = "family" if with_probs else None
            write_routes(str(model_dir), data, path, MAX_LEN, probs_transform=transform, top_m=top_m)
        handle.teacher = load_stored_routes(
            path, labelled, routers_sha256=fingerprint, moe_layers=[m.layer_index for m in layers],
            num_layers=model.config.get_text_config().num_hidden_layers, top_k=top_k,
            num_experts=int(layers[0].router.weight.shape[0]), transform=handle.router_transform,
        )  # fmt: skip
        if top_m is not None:  # no extra columns: read as the plain file, here and on Megatron's path
            assert handle.teacher.extra_BSLJ(batch["rpb_sample_index"]) is None
        seen = {}
        hooks = [m.moe.router.register_forward_hook(lambda mod, a, out, p=p, seen=seen: seen.__setitem__(p, out))
                 for p, m in enumerate(handle.layers)]  # fmt: skip
        with handle.step(batch["rpb_sample_index"], batch["rpb_span"], batch["attention_mask"]) as ctx:
            ctx.base = handle.base_routing(batch, batch["rpb_sample_index"])
            model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"])
            term = handle.loss()
        for h in hooks:
            h.remove()
        per_layer = []
        for pos in range(len(layers)):
            ids_TK = base_out[pos][2].reshape(valid_T.shape[0], -1)[valid_T].long()
            log_p_TE = probs(seen[pos][0].detach(), sigmoid)[valid_T].log()
            log_p_TK = log_p_TE.gather(-1, ids_TK)
            if with_probs and form is None:  # the bucket: k stored cells and one for the rest, as they are
                q_TK = probs(base_out[pos][0], sigmoid)[valid_T].gather(-1, ids_TK)
                p_TK, q_rest, p_rest = log_p_TK.exp(), 1 - q_TK.sum(-1), 1 - log_p_TK.exp().sum(-1)
                kl = (q_TK * (q_TK.log() - p_TK.log())).sum(-1) + q_rest * (q_rest.log() - p_rest.log())
                per_layer.append(kl.mean())
            elif with_probs:
                q_TK = probs(base_out[pos][0], sigmoid)[valid_T].gather(-1, ids_TK)
                q_TK = q_TK / q_TK.sum(-1, keepdim=True)
                per_layer.append((q_TK * (q_TK.log() - log_p_TK)).sum(-1).mean())
            else:
                per_layer.append(-log_p_TK.mean(-1).mean())
        hand = LAMBDA * torch.stack(per_layer).mean()
        assert float(term.detach()) == pytest.approx(float(hand), rel=1e-4), (
            f"{name}, probabilities stored: {with_probs}, {form or 'default'}, top-m {top_m}"
        )
    handle.remove()
    # the bucket form on the base itself (the model not moved): 0 to float precision, on every family
    at_base = load_causal_lm(str(model_dir)).train()
    handle = install_anchor(at_base, AnchorConfig(method="routing-kd", lambda_=LAMBDA, base="routes", routes="x"))
    handle.teacher = load_stored_routes(
        tmp / "routes-True.safetensors", labelled, routers_sha256=fingerprint,
        moe_layers=[m.layer_index for m in layers], num_layers=model.config.get_text_config().num_hidden_layers,
        top_k=top_k, num_experts=int(layers[0].router.weight.shape[0]), transform=handle.router_transform,
    )  # fmt: skip
    with handle.step(batch["rpb_sample_index"], batch["rpb_span"], batch["attention_mask"]) as ctx:
        ctx.base = handle.base_routing(batch, batch["rpb_sample_index"])
        at_base(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"])
        assert float(handle.loss().detach()) == pytest.approx(0.0, abs=1e-6), f"{name}: the bucket at the base"
    handle.remove()


def stored_teacher(handle, path, labelled, model, fingerprint):
    layers = handle.layers
    return load_stored_routes(
        path, labelled, routers_sha256=fingerprint, moe_layers=[m.moe.layer_index for m in layers],
        num_layers=model.config.get_text_config().num_hidden_layers, top_k=layers[0].spec.top_k,
        num_experts=layers[0].spec.num_experts, transform=handle.router_transform,
    )  # fmt: skip


def term_and_grads(model, handle, batch) -> tuple[float, dict]:
    model.zero_grad(set_to_none=True)
    with handle.step(batch["rpb_sample_index"], batch["rpb_span"], batch["attention_mask"]) as ctx:
        ctx.base = handle.base_routing(batch, batch["rpb_sample_index"])
        model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"])
        term = handle.loss()
        term.backward()
    grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    return float(term.detach()), grads


@pytest.mark.parametrize("name", ["qwen3_30b_a3b", "deepseek_v3"])  # softmax; sigmoid with groups and a bias
def test_a_whole_distribution_route_file_is_online_routing_kd(name, family):
    """``rpb routes --with-probs --top-m E``: the bucket form over every expert is online ``routing-kd``'s KL,
    its value and its gradient, on the same batch of the same moved model."""
    model_dir, data, tmp = family(name)
    model = load_causal_lm(str(model_dir)).train()
    facts = get_adapter(model.config.model_type)
    layers = find_moe_layers(model, facts)
    E = int(layers[0].router.weight.shape[0])
    fingerprint = routers_sha256(layers, facts)
    path = tmp / "routes-whole.safetensors"
    write_routes(str(model_dir), data, path, MAX_LEN, probs_transform="family", top_m=E)
    routes = load_routes(path)
    assert routes.metadata["schema_version"] == 2 and routes.top_m == E
    # the stored experts of every token and layer: the routed K first (the file's routes), then every other expert
    # once, in falling probability
    every_RXE = torch.cat([routes.routes_RXK, routes.extra_ids_RXJ], -1).long()
    at = [m.layer_index for m in layers]
    assert torch.equal(every_RXE[:, at].sort(-1).values, torch.arange(E).expand(every_RXE[:, at].shape))
    extra_RXJ = routes.extra_probs_RXJ[:, at]
    assert bool((extra_RXJ[..., 1:] <= extra_RXJ[..., :-1]).all())
    batch = batch_of(model_dir, data)
    labelled = load_labelled(str(data), load_tokenizer(str(model_dir)), MAX_LEN)
    handle = install_anchor(model, AnchorConfig(method="routing-kd", lambda_=LAMBDA))
    handle.teacher = online_base(model, facts, model_id=str(model_dir), dtype=None, outputs=False)
    move(model, facts)  # after the base is taken: the base stays the checkpoint's
    online, online_grads = term_and_grads(model, handle, batch)
    handle.remove()
    handle = install_anchor(model, AnchorConfig(method="routing-kd", lambda_=LAMBDA, base="routes", routes=str(path)))
    handle.teacher = stored_teacher(handle, path, labelled, model, fingerprint)
    assert handle.teacher.top_m == E and handle.teacher.routes_loss == "bucket"
    stored, stored_grads = term_and_grads(model, handle, batch)
    handle.remove()
    assert online > 1e-3, f"{name}: the drift should move the routing"
    assert stored == pytest.approx(online, abs=1e-6)
    assert online_grads.keys() == stored_grads.keys() and len(online_grads) > len(layers)
    worst = max(float((online_grads[n] - stored_grads[n]).abs().max()) for n in online_grads)
    assert worst <= 1e-6, f"{name}: gradients differ by {worst:.2e}"


@pytest.mark.parametrize("name", REPLICAS)
def test_the_ids_alone_hinge_is_active_exactly_where_the_models_own_rule_loses_the_bases_set(name, family):
    """``anchor.routes_loss: hinge`` from an ids-alone route file: 0 on the base itself, and after a known drift
    active on exactly the tokens whose set, as the model's own router returns it (the test's hooks), differs from
    the base's stored one, in every MoE layer."""
    model_dir, data, tmp = family(name)
    model = load_causal_lm(str(model_dir)).train()
    facts = get_adapter(model.config.model_type)
    fingerprint = routers_sha256(find_moe_layers(model, facts), facts)
    path = tmp / "routes-False.safetensors"
    if not path.is_file():
        write_routes(str(model_dir), data, path, MAX_LEN)
    batch = batch_of(model_dir, data)
    labelled = load_labelled(str(data), load_tokenizer(str(model_dir)), MAX_LEN)
    valid_T = batch["attention_mask"].reshape(-1).bool()
    config = AnchorConfig(method="routing-kd", lambda_=LAMBDA, base="routes", routes=str(path), routes_loss="hinge")
    for moved in (False, True):
        if moved:
            move(model, facts)
        handle = install_anchor(model, config, record_stats=True)
        handle.teacher = stored_teacher(handle, path, labelled, model, fingerprint)
        seen = {}
        hooks = [m.moe.router.register_forward_hook(lambda mod, a, out, p=p, seen=seen: seen.__setitem__(p, out))
                 for p, m in enumerate(handle.layers)]  # fmt: skip
        term, _ = term_and_grads(model, handle, batch)
        for h in hooks:
            h.remove()
        base = handle.teacher.step(batch["rpb_sample_index"])
        for pos in range(len(handle.layers)):
            own_TK = seen[pos][2].reshape(valid_T.shape[0], -1).long()
            lost_T = (own_TK.sort(-1).values != base.ids_LTK[pos].sort(-1).values).any(-1) & valid_T
            stats = handle.stats[pos]
            assert (stats.hinge_active, stats.hinge_tokens) == (int(lost_T.sum()), int(valid_T.sum())), (name, pos)
        lost = sum(handle.stats[pos].hinge_active for pos in handle.stats)
        handle.remove()
        if not moved:
            assert term == 0.0 and lost == 0, f"{name}: the hinge at the base itself"
        else:
            assert term > 0 and lost > 0, f"{name}: the drift should lose some of the base's sets"
