"""The guard that never lets a setting or a Bridge line drop the anchor, on containers shaped as Bridge's.

Nothing imports megatron.bridge: the recipe module is a stand-in holding the values Bridge's own
recipes set (0.6.2's ``moonlight_16b_sft_8gpu_h100_bf16_tp1_config``, which 0.6.x aliases as
``moonlight_16b_sft_config``, read from its wheel), so the checks run on every line's shape.
"""

from __future__ import annotations

import logging
import sys
import types
from types import SimpleNamespace

import pytest
import torch

from rpb.anchors.methods import METHODS
from rpb.errors import ConfigError
from rpb.integrations.megatron.bridge import AnchoredForwardStep, build_container
from rpb.integrations.megatron.config import load_megatron_config
from rpb.integrations.megatron.guard import check_container, container_problems

RECIPE = "megatron.bridge.recipes.moonlight"


def ns(**fields) -> SimpleNamespace:
    return SimpleNamespace(**fields)


def recipe_0_6() -> SimpleNamespace:
    """The anchor-relevant fields as Bridge 0.6.2's Moonlight SFT recipe sets them."""
    model = ns(
        tensor_model_parallel_size=1, pipeline_model_parallel_size=1, virtual_pipeline_model_parallel_size=None,
        context_parallel_size=1, expert_model_parallel_size=8, moe_router_fusion=True, mtp_num_layers=None,
        moe_token_dispatcher_type="flex", moe_flex_dispatcher_backend="hybridep", moe_shared_expert_overlap=False,
        moe_a2a_overlap=False, cuda_graph_impl="none", overlap_moe_expert_parallel_comm=False,
        delay_wgrad_compute=False,
    )  # fmt: skip
    bf16 = torch.bfloat16
    optimizer = ns(use_precision_aware_optimizer=True, main_params_dtype=torch.float32, main_grads_dtype=bf16,
                   exp_avg_dtype=bf16, exp_avg_sq_dtype=bf16)  # fmt: skip
    return ns(
        model=model, optimizer=optimizer, scheduler=ns(), train=ns(), rng=ns(), checkpoint=ns(), logger=ns(),
        tokenizer=ns(), ddp=ns(grad_reduce_in_fp32=False),
        comm_overlap=ns(tp_comm_overlap=False, overlap_moe_expert_parallel_comm=True, delay_wgrad_compute=True),
    )  # fmt: skip


@pytest.fixture
def recipe_0_6_installed(monkeypatch):
    module = types.ModuleType(RECIPE)
    module.moonlight_16b_sft_config = recipe_0_6
    monkeypatch.setitem(sys.modules, RECIPE, module)


def run_config():
    return load_megatron_config(None, ["model.pretrained_checkpoint=/ckpt", "data.root=/data", "train.output_dir=/o",
                                       "prior=/p.safetensors"])  # fmt: skip


def test_build_container_turns_the_newer_recipes_overlap_off_and_says_so(recipe_0_6_installed, caplog):
    with caplog.at_level(logging.WARNING, logger="rpb.integrations.megatron.guard"):
        c = build_container(run_config())
    assert c.comm_overlap.overlap_moe_expert_parallel_comm is False and c.comm_overlap.delay_wgrad_compute is False
    assert c.model.overlap_moe_expert_parallel_comm is False and c.model.delay_wgrad_compute is False
    # the same run as on v0.3.1: its dispatcher, no router fusion, its optimizer precision
    assert c.model.moe_token_dispatcher_type == "alltoall" and c.model.moe_router_fusion is False
    assert c.optimizer.main_grads_dtype is torch.bfloat16 and c.optimizer.main_params_dtype is torch.float32
    said = caplog.text
    for changed in ("comm_overlap.overlap_moe_expert_parallel_comm: True -> False",
                    "comm_overlap.delay_wgrad_compute: True -> False",
                    "model.moe_token_dispatcher_type: 'flex' -> 'alltoall'"):  # fmt: skip
        assert changed in said
    assert "main_grads_dtype" not in said  # unchanged values are not reported


#: a value the anchor cannot run with, per setting, and a word of the reason the refusal must give
REFUSED = {
    "comm_overlap.overlap_moe_expert_parallel_comm": (True, "1F1B"),
    "model.overlap_moe_expert_parallel_comm": (True, "1F1B"),
    "comm_overlap.delay_wgrad_compute": (True, "weight-gradient"),
    "model.delay_wgrad_compute": (True, "weight-gradient"),
    "model.cuda_graph_impl": ("transformer_engine", "CUDA graphs"),
    "model.virtual_pipeline_model_parallel_size": (2, "interleaved"),
    "model.pipeline_model_parallel_size": (2, "pipeline parallelism"),
    "model.context_parallel_size": (2, "context parallelism"),
    "model.moe_router_fusion": (True, "fused router"),
    "model.mtp_num_layers": (1, "multi-token"),
    # told no method, the guard refuses a routing replay (it binds the methods that choose the top-k)
    "model.moe_enable_routing_replay": (True, "routing replay"),
}


def allowed_container() -> SimpleNamespace:
    c = recipe_0_6()
    c.comm_overlap.overlap_moe_expert_parallel_comm = c.comm_overlap.delay_wgrad_compute = False
    c.model.moe_router_fusion = False
    return c


@pytest.mark.parametrize("path", sorted(REFUSED))
def test_each_setting_is_refused_with_its_reason(path):
    c = allowed_container()
    assert container_problems(c) == []
    value, reason = REFUSED[path]
    owner, name = path.split(".")
    setattr(getattr(c, owner), name, value)
    problems = container_problems(c)
    assert len(problems) == 1 and problems[0].startswith(f"{path}: {value!r}") and reason in problems[0]
    with pytest.raises(ConfigError, match="1 problem"):
        check_container(c)


def test_a_line_without_the_setting_is_not_refused_for_it():
    c = allowed_container()
    del c.model.mtp_num_layers  # an older line with no such field
    c.comm_overlap = None  # no overlap config at all (Bridge's default)
    assert container_problems(c) == []


def test_every_refused_setting_together_is_listed_at_once():
    c = allowed_container()
    for path, (value, _) in REFUSED.items():
        owner, name = path.split(".")
        setattr(getattr(c, owner), name, value)
    with pytest.raises(ConfigError, match=f"{len(REFUSED)} problem"):
        check_container(c)


def test_the_forward_step_refuses_a_schedule_plan():
    """Bridge asks for one under EP overlap: the loss would leave without the anchor's term."""
    step = AnchoredForwardStep(cfg=None, prepared=None)
    with pytest.raises(RuntimeError, match=r"schedule plan.*overlap_moe_expert_parallel_comm=False"):
        step(ns(), iter([]), model=None, return_schedule_plan=True)


#: every method of the table, by what Megatron's routing replay means for it (docs/megatron.md, Routing replay):
#: these choose the top-k through the hook the replay uses, so the replayed routes would override their choice
SELECTING = (
    "rpb", "rpb-hard", "within-soft", "within-hard", "global-hard", "within-transition-soft", "within-transition-hard",
)  # fmt: skip
#: these keep Megatron's selection (the replayed one, under replay); the loss terms read the live logits
KEEPING = (
    "sft", "lbl", "router-l2", "kl-to-base", "logit-l2", "router-freeze", "routing-kd", "output-kd",
    "routing-kd-router", "hidden-kd",
)  # fmt: skip


def test_every_method_is_decided_for_routing_replay():
    """A method added to the table must be placed in one of the two lists above."""
    assert sorted(SELECTING + KEEPING) == sorted(METHODS)


@pytest.mark.parametrize("method", SELECTING)
def test_routing_replay_is_refused_for_the_methods_that_choose_the_top_k(method):
    c = allowed_container()
    c.model.moe_enable_routing_replay = False
    assert container_problems(c, method) == []
    c.model.moe_enable_routing_replay = True
    problems = container_problems(c, method)
    assert len(problems) == 1 and problems[0].startswith("model.moe_enable_routing_replay: True")
    assert "replayed routes would override the biased choice" in problems[0]
    assert "no effect on selection" in problems[0]
    with pytest.raises(ConfigError, match="1 problem"):
        check_container(c, method=method)


@pytest.mark.parametrize("method", KEEPING)
def test_routing_replay_is_accepted_for_the_loss_anchors_and_the_native_selection(method):
    c = allowed_container()
    c.model.moe_enable_routing_replay = True
    assert container_problems(c, method) == []
    check_container(c, method=method)
    # the method-independent rules still bind them
    c.model.moe_router_fusion = True
    assert [p.partition(":")[0] for p in container_problems(c, method)] == ["model.moe_router_fusion"]
