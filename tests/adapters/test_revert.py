"""Routers put back: on every shipped replica, each router tensor becomes the source's bit for bit (in the
receiving model's dtype), nothing else moves, and a model that differed only in its routers gives the source's
logits exactly; models whose routers differ in shape are refused with every difference named."""

from __future__ import annotations

import copy

import pytest
import torch

from rpb.adapters import find_moe_layers, get_adapter
from rpb.adapters.fingerprint import router_tensors
from rpb.adapters.revert import put_routers, routers_of
from rpb.errors import ArgumentError
from rpb.models import load_causal_lm
from rpb.testing import replica as build_replica
from rpb.testing.replicas import REPLICAS

pytestmark = pytest.mark.usefixtures("one_thread")


def _logits(model, ids):
    with torch.no_grad():
        return model(input_ids=ids).logits


@pytest.mark.parametrize("name", REPLICAS)
def test_the_base_routers_go_back_and_nothing_else_moves(name, replica, tmp_path):
    base = load_causal_lm(str(replica(name))).eval()
    post = load_causal_lm(str(build_replica(name, tmp_path / "post", seed=1))).eval()  # other weights throughout
    facts = get_adapter(base.config.model_type)
    before = {k: v.clone() for k, v in post.state_dict().items()}
    copied = put_routers(post, base, facts)
    routers = []
    for b, p in zip(find_moe_layers(base, facts), find_moe_layers(post, facts), strict=True):
        for tensor_name, t in router_tensors(p, facts).items():
            assert torch.equal(t, router_tensors(b, facts)[tensor_name].to(t.dtype)), (name, p.name, tensor_name)
            routers.append(t)
    # each copied tensor named as the model's own state dict names it (MiniMax-M2's expert bias: its block's)
    keys = {k for k, v in post.state_dict(keep_vars=True).items() if any(v is t for t in routers)}
    assert set(copied) == keys, name
    after = post.state_dict()
    moved = {k for k in after if not torch.equal(after[k], before[k])}
    assert moved and moved <= keys, (name, moved - keys)  # only the routers moved (zero-initialised biases stay)


@pytest.mark.parametrize("name", ["deepseek_v3", "gpt_oss_20b", "minimax_m2", "qwen3_30b_a3b"])
def test_a_model_that_differs_only_in_its_routers_gives_the_sources_logits(name, replica):
    """Moved by hand: the weight, and the router bias and expert-correction bias where the family has them."""
    base = load_causal_lm(str(replica(name))).eval()
    post = copy.deepcopy(base)
    facts = get_adapter(base.config.model_type)
    gen = torch.Generator().manual_seed(3)
    with torch.no_grad():
        for m in find_moe_layers(post, facts):
            for t in router_tensors(m, facts).values():
                t.add_(torch.randn(t.shape, generator=gen).to(t.dtype) * 0.5)
    ids = torch.randint(0, base.config.get_text_config().vocab_size, (2, 12), generator=gen)
    assert not torch.equal(_logits(post, ids), _logits(base, ids))  # the move changes the output
    put_routers(post, base, facts)
    assert torch.equal(_logits(post, ids), _logits(base, ids))


def test_routers_of_other_shapes_are_refused_with_every_difference_and_nothing_copied(replica):
    base = load_causal_lm(str(replica("qwen3_30b_a3b"))).eval()
    post = copy.deepcopy(base)
    facts = get_adapter(base.config.model_type)
    layers = find_moe_layers(post, facts)
    for m in layers:  # one expert fewer in every router
        m.router.weight = torch.nn.Parameter(m.router.weight.detach()[:-1].clone() + 1.0)
    kept = [m.router.weight.detach().clone() for m in layers]
    with pytest.raises(ArgumentError) as err:
        put_routers(post, base, facts)
    text = str(err.value)
    assert f"{len(layers)} difference(s)" in text and "nothing was copied" in text
    for m in layers:
        assert f"layer {m.layer_index}: weight of shape [{m.router.weight.shape[0]}, " in text
    assert all(torch.equal(m.router.weight, k) for m, k in zip(layers, kept, strict=True))


@pytest.mark.parametrize("name", ["gpt_oss_20b", "minimax_m2"])
def test_routers_of_runs_with_the_sources_routers_and_restores_its_own_even_on_an_error(name, replica, tmp_path):
    base = load_causal_lm(str(replica(name))).eval()
    post = load_causal_lm(str(build_replica(name, tmp_path / "post", seed=1))).eval()
    facts = get_adapter(base.config.model_type)
    before = {k: v.clone() for k, v in post.state_dict().items()}
    with pytest.raises(RuntimeError, match="inside"), routers_of(post, base, facts):
        for b, p in zip(find_moe_layers(base, facts), find_moe_layers(post, facts), strict=True):
            for tensor_name, t in router_tensors(p, facts).items():
                assert torch.equal(t, router_tensors(b, facts)[tensor_name])
        raise RuntimeError("inside")
    assert all(torch.equal(post.state_dict()[k], v) for k, v in before.items())


def test_the_shared_expert_gates_are_copied_under_their_own_names_when_asked(replica, tmp_path):
    base = load_causal_lm(str(replica("qwen1_5_moe_a2_7b"))).eval()
    post = load_causal_lm(str(build_replica("qwen1_5_moe_a2_7b", tmp_path / "post", seed=1))).eval()
    facts = get_adapter(base.config.model_type)
    assert facts.shared_gate == "shared_expert_gate"
    plain = put_routers(copy.deepcopy(post), base, facts)
    names = put_routers(post, base, facts, shared_gates=True)
    gates = sorted(set(names) - set(plain))
    layers = find_moe_layers(post, facts)
    assert gates == sorted(f"{m.name.rpartition('.')[0]}.shared_expert_gate.weight" for m in layers)
    theirs = base.state_dict()
    assert all(torch.equal(post.state_dict()[g], theirs[g]) for g in gates)
    assert (
        get_adapter("qwen3_5_moe").shared_gate == "shared_expert_gate" and get_adapter("qwen3_moe").shared_gate is None
    )
