"""The GRPO set-up's checks on their own: every conflict of a config is named at once, each by its field."""

from __future__ import annotations

from types import SimpleNamespace

from rpb.integrations.trl.grpo_checks import config_problems, trainer_problems


def test_every_conflict_of_a_config_is_named_at_once():
    args = SimpleNamespace(router_aux_loss_coef=0.01, loss_type="made-up", replay="R9", routes_format="json",
                           rollout_dtype="float16", bf16=False, fp16=False)  # fmt: skip
    said = "\n".join(config_problems(args))
    for field in ("router_aux_loss_coef=0.01", "loss_type='made-up'", "replay='R9'", "routes_format='json'",
                  "rollout_dtype='float16'"):  # fmt: skip
        assert field in said
    fine = SimpleNamespace(router_aux_loss_coef=0.0, loss_type="grpo", replay="off", routes_format="vllm",
                           rollout_dtype=None, bf16=True, fp16=False)  # fmt: skip
    assert config_problems(fine) == []


def test_an_engine_without_routes_under_r3_is_refused_unless_a_rollout_func_hands_them_in():
    args = SimpleNamespace(replay="R3", use_vllm=True)
    assert any("use_vllm with replay='R3'" in p for p in trainer_problems(args, None, None))
    assert trainer_problems(args, None, None, has_rollout_func=True) == []


def test_pr2_without_a_positive_lr_scale_or_under_deepspeed_is_refused():
    args = SimpleNamespace(router_aux_loss_coef=0.0, loss_type="grpo", replay="PR2", routes_format="vllm",
                           rollout_dtype=None, bf16=False, fp16=False, pr2_lr_scale=0.0)  # fmt: skip
    assert any("pr2_lr_scale=0.0" in p for p in config_problems(args))
    args.pr2_lr_scale = 1000.0
    assert config_problems(args) == []
    args.deepspeed = "ds_config.json"  # DeepSpeed steps its own optimizer: the predictor has no place in it
    assert any("replay='PR2' with deepspeed" in p for p in config_problems(args))
