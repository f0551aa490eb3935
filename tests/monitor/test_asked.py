"""``rpb.monitor.asked``: what the audit reads as asked, from an ``rpb train`` configuration and from the model as
the user left it (routers frozen by hand before rpb's LoRA wrap, a user's own PEFT wrap, the native aux switch)."""

from __future__ import annotations

import json
import logging

import pytest
import torch

from rpb.adapters import find_moe_layers, get_adapter
from rpb.anchors import AnchorConfig
from rpb.monitor import Asked
from rpb.monitor.asked import asked_from_config, asked_from_model
from rpb.testing.models import build_tiny_model
from rpb.train.config import RunConfig, TrainSection
from rpb.train.lora import LoraSection, apply_lora

pytestmark = pytest.mark.usefixtures("one_thread")
FACTS = get_adapter("qwen3_moe")


def layers_of(model):
    return find_moe_layers(model, FACTS)


@pytest.mark.parametrize("non_expert_modules", [False, True])
def test_only_experts_freezes_the_router_unless_the_choice_trains_non_expert_modules(tmp_path, non_expert_modules):
    choice = tmp_path / "experts.json"
    choice.write_text(json.dumps({"experts": {"0": [1]}, "non_expert_modules": non_expert_modules}))
    cfg = RunConfig(anchor=AnchorConfig(method="sft"), train=TrainSection(only_experts=str(choice)))
    expected = "free" if non_expert_modules else "frozen"
    assert asked_from_config(cfg) == Asked(expected, None, native_aux=False)


def test_a_router_frozen_by_hand_before_rpbs_lora_counts_frozen_where_peft_wraps_it():
    model = build_tiny_model("qwen3_moe", vocab_size=64)
    first = layers_of(model)[0]
    first.router.weight.requires_grad_(False)  # by hand, before the wrap; the other layers' routers stay free
    wrapped = apply_lora(model, LoraSection(rank=4, router="full"), FACTS)
    layers = layers_of(wrapped)
    assert all(m.wrapper is not None and m.trainable for m in layers)  # PEFT's trainable copies hide the freeze
    assert asked_from_model(wrapped, layers) == Asked("free", native_aux=False, frozen_layers=(first.layer_index,))


def test_every_router_frozen_before_rpbs_lora_is_the_router_frozen():
    model = build_tiny_model("qwen3_moe", vocab_size=64)
    for m in layers_of(model):
        m.router.weight.requires_grad_(False)
    wrapped = apply_lora(model, LoraSection(rank=4, router="lora"), FACTS)
    assert asked_from_model(wrapped, layers_of(wrapped)).router == "frozen"


def test_a_router_the_user_wrapped_counts_free_with_one_warning_naming_the_asked_field(caplog):
    from peft import LoraConfig, get_peft_model

    model = build_tiny_model("qwen3_moe", vocab_size=64)
    for m in layers_of(model):
        m.router.weight.requires_grad_(False)
    wrapped = get_peft_model(model, LoraConfig(r=4, target_modules=["q_proj"], modules_to_save=["mlp.gate"]))
    with caplog.at_level(logging.WARNING, logger="rpb.monitor.asked"):
        asked = asked_from_model(wrapped, layers_of(wrapped))
    assert asked.router == "free" and asked.frozen_layers == ()
    assert len(caplog.records) == 1 and 'Asked(router="frozen")' in caplog.records[0].getMessage()


def test_a_user_wrap_leaving_the_routers_out_is_read_without_a_warning(caplog):
    """PEFT froze the routers it did not wrap: frozen, whatever the user did before, so nothing to warn about."""
    from peft import LoraConfig, get_peft_model

    wrapped = get_peft_model(build_tiny_model("qwen3_moe", vocab_size=64), LoraConfig(r=4, target_modules=["q_proj"]))
    with caplog.at_level(logging.WARNING, logger="rpb.monitor.asked"):
        assert asked_from_model(wrapped, layers_of(wrapped)).router == "frozen"
    assert caplog.records == []


@pytest.mark.parametrize(
    ("output_router_logits", "coefficient", "expected"),
    [(True, 0.5, True), (True, 0.0, False), (False, 0.5, False)],
)
def test_the_native_aux_loss_is_asked_as_the_models_config_sets_it(output_router_logits, coefficient, expected):
    model = build_tiny_model(
        "qwen3_moe", vocab_size=64, output_router_logits=output_router_logits, router_aux_loss_coef=coefficient
    )
    assert asked_from_model(model, layers_of(model)).native_aux is expected
    torch.manual_seed(0)
    wrapped = apply_lora(model, LoraSection(rank=4), FACTS)  # read through PEFT's wrapper too
    assert asked_from_model(wrapped, layers_of(wrapped)).native_aux is expected
