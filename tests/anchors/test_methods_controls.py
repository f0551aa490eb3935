"""The two controls of why ``routing-kd`` holds (docs/methods.md), on real-config replicas, read against the test's
own hooks: ``routing-kd-router`` is routing-kd's term with the gradient reaching the routers' weights alone, and
``hidden-kd`` the relative drift of each MoE router's input from the base's, computed here from two forwards."""

from __future__ import annotations

import pytest
import torch

from rpb.adapters import find_moe_layers, get_adapter
from rpb.anchors import AnchorConfig, install_anchor
from rpb.errors import ArgumentError
from rpb.models import load_causal_lm
from rpb.teacher import online_base
from rpb.testing.data import conversations, write_jsonl
from tests.project.test_family_matrix import batch_of
from tests.teacher.test_routing_kd_matrix import move, term_and_grads

pytestmark = pytest.mark.usefixtures("one_thread")
LAMBDA = 0.5


def anchored(model_dir, method: str):
    model = load_causal_lm(str(model_dir)).train()
    facts = get_adapter(model.config.model_type)
    handle = install_anchor(model, AnchorConfig(method=method, lambda_=LAMBDA))
    handle.teacher = online_base(model, facts, model_id=str(model_dir), dtype=None, outputs=False)
    move(model, facts)  # after the base is taken
    return model, facts, handle


@pytest.mark.parametrize("name", ["deepseek_v3", "gpt_oss_20b"])  # a correction bias; a router with its own bias
def test_router_only_is_routing_kds_term_with_its_gradient_on_the_routers_alone(name, replica, tmp_path):
    model_dir = replica(name)
    batch = batch_of(model_dir, write_jsonl(conversations(4, seed=5), tmp_path / "train.jsonl"))
    model, facts, handle = anchored(model_dir, "routing-kd")
    full, full_grads = term_and_grads(model, handle, batch)
    handle.remove()
    model, facts, handle = anchored(model_dir, "routing-kd-router")
    router_only, grads = term_and_grads(model, handle, batch)
    handle.remove()
    assert full > 1e-4 and router_only == pytest.approx(full, rel=1e-5)
    layers = find_moe_layers(model, facts)
    names = {id(p): n for n, p in model.named_parameters()}
    routers = {names[id(q)] for m in layers for q in m.router.parameters(recurse=False)}
    assert routers <= grads.keys() and all(float(grads[n].abs().max()) > 0 for n in routers)
    # the last router shapes no later router's input, so routing-kd reaches its weights by the direct path alone:
    # the same gradient; an earlier router's differs by what the layers above pass back
    for q in layers[-1].router.parameters(recurse=False):
        torch.testing.assert_close(grads[names[id(q)]], full_grads[names[id(q)]], rtol=1e-4, atol=1e-7)
    below = [n for n in grads if n not in routers and float(grads[n].abs().max()) > 0]
    assert below == [], f"{name}: the router-only term moved {below[:3]}"
    assert any(float(full_grads[n].abs().max()) > 0 for n in full_grads if n not in routers)


def test_hidden_kd_is_the_relative_drift_of_each_routers_input_from_the_bases(replica, tmp_path):
    model_dir = replica("deepseek_v3")
    batch = batch_of(model_dir, write_jsonl(conversations(4, seed=5), tmp_path / "train.jsonl"))
    model, facts, handle = anchored(model_dir, "hidden-kd")
    base = load_causal_lm(str(model_dir)).eval()

    def router_inputs(m):
        seen = {}
        hooks = [x.router.register_forward_pre_hook(lambda mod, args, p=p: seen.__setitem__(p, args[0].detach()))
                 for p, x in enumerate(find_moe_layers(m, facts))]  # fmt: skip
        with torch.no_grad():
            m(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"])
        for h in hooks:
            h.remove()
        return seen

    valid_T = batch["attention_mask"].reshape(-1).bool()
    h_base, h_now = router_inputs(base), router_inputs(model)
    per_layer = []
    for p in sorted(h_base):
        b = h_base[p].double().reshape(valid_T.shape[0], -1)[valid_T]
        h = h_now[p].double().reshape(valid_T.shape[0], -1)[valid_T]
        per_layer.append(((h - b) ** 2).sum(-1).mean() / (b**2).sum(-1).mean())
    term, grads = term_and_grads(model, handle, batch)
    assert float(per_layer[0]) > 1e-4
    assert term == pytest.approx(LAMBDA * float(torch.stack(per_layer).mean()), rel=1e-4)
    last = {id(q) for q in find_moe_layers(model, facts)[-1].router.parameters()}
    moved = [n for n, p in model.named_parameters() if n in grads and float(grads[n].abs().max()) > 0]
    assert any("self_attn" in n for n in moved)  # the layers below the routers take it
    # no routing in it: the last router's weights shape nothing its own input or an earlier one depends on
    assert not any(id(p) in last for n, p in model.named_parameters() if n in moved)
    handle.remove()


def test_what_the_controls_cannot_serve_is_refused_by_name(replica):
    from rpb.errors import ConfigError
    from rpb.train.config import load_config

    with pytest.raises(ConfigError, match="hidden-kd holds the routers' inputs to the base's"):
        load_config(None, ["model=m", "data_jsonl=d", "output_dir=o", "anchor.method=hidden-kd", "anchor.lambda=1",
                           "anchor.base=routes", "anchor.routes=r.safetensors"])  # fmt: skip
    model = load_causal_lm(str(replica("deepseek_v3")))
    for layer in find_moe_layers(model, get_adapter(model.config.model_type)):
        layer.router.requires_grad_(False)  # as under LoRA: the routers cannot train
    with pytest.raises(ArgumentError, match="no router of this model can train"):
        install_anchor(model, AnchorConfig(method="routing-kd-router", lambda_=1.0))
