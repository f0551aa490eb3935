"""routing-kd in rpb's GRPO on a tiny Qwen3-MoE saved to disk: with beta > 0 the reference model's routing is reused
(no forward added, counted by hooks of the test's own) and the term is the hand KL between the reference forward's
router logits and the training forward's, matched row by row by their tokens; with beta = 0 under LoRA the policy
with its adapters off gives the base; what GRPO cannot serve is refused by name."""

from __future__ import annotations

import math

import datasets
import pytest
import torch
from transformers import AutoModelForCausalLM

from rpb.adapters import find_moe_layers, get_adapter
from rpb.anchors import AnchorConfig, install_anchor
from rpb.errors import ConfigError
from rpb.integrations.trl import GRPOTrainer
from rpb.integrations.trl.base_routing import step_routing
from tests.integrations.trl.test_grpo import PROMPTS, grpo_args, reward

pytestmark = pytest.mark.usefixtures("one_thread")
LAMBDA = 0.5


def trainer_with(tok, save_tiny, tmp_path, method, move=False, **overrides):
    model = AutoModelForCausalLM.from_pretrained(save_tiny("qwen3_moe")).train()
    anchor = install_anchor(model, AnchorConfig(method=method, lambda_=LAMBDA))
    data = datasets.Dataset.from_list([{"prompt": p} for p in PROMPTS[:4]])
    args = grpo_args(tmp_path, max_steps=1, per_device_train_batch_size=8, num_generations=4, steps_per_generation=1,
                     loss_type="bnpo", **overrides)  # fmt: skip
    trainer = GRPOTrainer(model, reward, args, data, processing_class=tok, anchor=anchor)
    if move:  # the policy drifts from the reference (a copy loaded at construction): the routing differs
        gen = torch.Generator().manual_seed(5)
        with torch.no_grad():
            for name, p in model.named_parameters():
                if "self_attn" in name or name.endswith("mlp.gate.weight"):
                    p.add_(torch.randn(p.shape, generator=gen) * 0.3 * p.std())
    return trainer, anchor


def forwards_of(trainer) -> dict[str, int]:
    """How many forwards the policy and the reference model run (hooks of the test's own)."""
    count = {"policy": 0, "reference": 0}
    for name, model in (("policy", trainer.model), ("reference", trainer.ref_model)):
        model.register_forward_pre_hook(lambda *a, name=name: count.__setitem__(name, count[name] + 1))
    return count


def test_with_beta_the_reference_forward_gives_the_routing_and_no_forward_is_added(tok, save_tiny, tmp_path):
    counts = {}
    for method in ("routing-kd", "kl-to-base"):
        trainer, anchor = trainer_with(tok, save_tiny, tmp_path / method, method, beta=0.1)
        counts[method] = forwards_of(trainer)
        trainer.train()
        anchor.remove()
        trainer.replay.remove()
    assert counts["routing-kd"] == counts["kl-to-base"] and counts["routing-kd"]["reference"] > 0


def router_watch(model, facts, seen: list):
    """Every forward's (input_ids, each MoE layer's router logits reshaped [B, S, E]), by hooks of the test's own."""
    layers = find_moe_layers(model, facts)
    state = {}

    def pre(module, args, kwargs):
        state["ids"] = kwargs.get("input_ids", args[0] if args else None)
        state["logits"] = {}
        seen.append(state | {"logits": state["logits"]})

    def on_router(pos):
        def hook(module, args, out):
            B, S = state["ids"].shape
            seen[-1]["logits"][pos] = out[0].detach().double().reshape(B, S, -1)

        return hook

    handles = [model.register_forward_pre_hook(pre, with_kwargs=True)]
    handles += [m.router.register_forward_hook(on_router(p)) for p, m in enumerate(layers)]
    return handles


def test_the_term_is_the_hand_kl_on_the_reference_models_routing_row_by_row(tok, save_tiny, tmp_path):
    trainer, anchor = trainer_with(tok, save_tiny, tmp_path, "routing-kd", move=True, beta=0.1)
    facts = get_adapter("qwen3_moe")
    ref_seen, policy_seen = [], []
    handles = router_watch(trainer.ref_model, facts, ref_seen) + router_watch(trainer.model, facts, policy_seen)
    trained = []
    prepare = trainer._prepare_inputs
    trainer._prepare_inputs = lambda batch: trained.append(prepare(batch)) or trained[-1]
    trainer.train()
    for h in handles:
        h.remove()
    (inputs,) = trained
    C = inputs["completion_ids"].shape[1]
    # the reference's rows by their tokens: q at the completion positions, per layer
    by_row = {}
    for f in ref_seen:
        for b in range(f["ids"].shape[0]):
            by_row[tuple(f["ids"][b].tolist())] = [f["logits"][p][b, -C:] for p in sorted(f["logits"])]
    ids = torch.cat([inputs["prompt_ids"], inputs["completion_ids"]], dim=1)
    train_forward = next(f for f in policy_seen if f["ids"].shape == ids.shape and torch.equal(f["ids"], ids))
    mask = inputs["completion_mask"].bool()
    per_layer = []
    for pos in sorted(train_forward["logits"]):
        kls = []
        for b in range(ids.shape[0]):
            q = torch.softmax(by_row[tuple(ids[b].tolist())][pos], -1)
            p = torch.softmax(train_forward["logits"][pos][b, -C:], -1)
            kls.append((q * (q.log() - p.log())).sum(-1)[mask[b]])
        per_layer.append(torch.cat(kls).mean())  # bnpo: every completion token of the micro-batch alike
    hand = LAMBDA * torch.stack(per_layer).mean()
    (logged,) = [h["anchor/routing-kd"] for h in trainer.state.log_history if "anchor/routing-kd" in h]
    assert float(hand) > 1e-3 and logged == pytest.approx(float(hand), rel=1e-4)
    anchor.remove()
    trainer.replay.remove()


def test_the_step_routing_keeps_each_completion_at_its_row_and_position():
    base_BCLE = torch.arange(2 * 3 * 2 * 4, dtype=torch.float32).reshape(2, 3, 2, 4)
    routing = step_routing(base_BCLE, prompt_len=2)
    L_T_E = torch.stack(routing.logits_LTE)
    assert L_T_E.shape == (2, 2 * 5, 4)
    for b in range(2):
        for c in range(3):
            for layer in range(2):
                assert torch.equal(L_T_E[layer, b * 5 + 2 + c], base_BCLE[b, c, layer])
        assert torch.equal(L_T_E[:, b * 5 : b * 5 + 2], torch.zeros(2, 2, 4))


def test_without_beta_under_lora_the_policy_with_adapters_off_is_the_base(tok, save_tiny, tmp_path):
    from peft import LoraConfig

    model = AutoModelForCausalLM.from_pretrained(save_tiny("qwen3_moe")).train()
    anchor = install_anchor(model, AnchorConfig(method="routing-kd", lambda_=LAMBDA))
    data = datasets.Dataset.from_list([{"prompt": p} for p in PROMPTS[:4]])
    lora = LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"], task_type="CAUSAL_LM")
    args = grpo_args(tmp_path, max_steps=2, per_device_train_batch_size=8, num_generations=4, learning_rate=1e-2)
    trainer = GRPOTrainer(model, reward, args, data, processing_class=tok, anchor=anchor, peft_config=lora)
    assert trainer.anchor.teacher.mode == "adapters-off" and trainer.ref_model is None
    trainer.train()
    terms = [h["anchor/routing-kd"] for h in trainer.state.log_history if "anchor/routing-kd" in h]
    # step 1: the adapters' B is 0, so the policy is the base and the KL is 0; step 2 has moved
    assert terms[0] == pytest.approx(0.0, abs=1e-7) and terms[-1] > 0
    layers = [m for m in trainer.model.modules() if hasattr(m, "merged_adapters")]
    assert layers and not any(m.disable_adapters for m in layers)
    trainer.anchor.remove()
    trainer.replay.remove()


@pytest.mark.parametrize(
    ("method", "base", "overrides", "message"),
    [
        ("output-kd", "online", {"beta": 0.1}, "TRL's beta is that term"),
        ("routing-kd", "routes", {"beta": 0.1}, "the completions are generated; use anchor.base=online"),
        ("routing-kd", "online", {"beta": 0.1, "sync_ref_model": True}, "set sync_ref_model=False"),
        ("routing-kd", "online", {}, "no reference forward runs, so the base must be given"),
        ("hidden-kd", "online", {"beta": 0.1}, "hidden-kd in GRPO: a control of why routing-kd holds"),
    ],
)
def test_what_grpo_cannot_serve_is_refused_by_name(method, base, overrides, message, tok, save_tiny, tmp_path):
    model = AutoModelForCausalLM.from_pretrained(save_tiny("qwen3_moe")).train()
    extra = {"routes": str(tmp_path / "r.safetensors")} if base == "routes" else {}
    anchor = install_anchor(model, AnchorConfig(method=method, lambda_=LAMBDA, base=base, **extra))
    data = datasets.Dataset.from_list([{"prompt": p} for p in PROMPTS[:4]])
    with pytest.raises(ConfigError, match=message):
        GRPOTrainer(model, reward, grpo_args(tmp_path, **overrides), data, processing_class=tok, anchor=anchor)


@pytest.mark.parametrize("replay", ["R2", "R3", "PR2"])
def test_a_routing_target_under_replay_is_refused_by_name(replay, tok, save_tiny, tmp_path):
    """Under replay the overlap reads the router on the replayed forward's hidden states (docs/rl.md): no drift."""
    model = AutoModelForCausalLM.from_pretrained(save_tiny("qwen3_moe")).train()
    anchor = install_anchor(model, AnchorConfig(method="routing-kd", target=0.9))
    data = datasets.Dataset.from_list([{"prompt": p} for p in PROMPTS[:4]])
    args = grpo_args(tmp_path, beta=0.1, replay=replay, num_iterations=2)
    with pytest.raises(ConfigError, match=rf"anchor.target with replay='{replay}'"):
        GRPOTrainer(model, reward, args, data, processing_class=tok, anchor=anchor)


def test_a_routing_target_in_grpo_steps_lambda_at_every_update_of_a_generation_batch(tok, save_tiny, tmp_path):
    """Two updates per generation batch (num_iterations 2), the reference forward's routing reused: each optimizer
    step logs its overlap and the λ the documented rule gives, simulated here from the logged overlaps; the monitor,
    on with no configuration, logs the base-forward figures beside them."""
    model = AutoModelForCausalLM.from_pretrained(save_tiny("qwen3_moe")).train()
    target = 0.999
    anchor = install_anchor(model, AnchorConfig(method="routing-kd", target=target))
    data = datasets.Dataset.from_list([{"prompt": p} for p in PROMPTS[:4]])
    steps = dict(
        max_steps=4, per_device_train_batch_size=8, num_generations=4, steps_per_generation=1, num_iterations=2
    )
    args = grpo_args(tmp_path, **steps, beta=0.1, learning_rate=5e-2, lr_scheduler_type="constant", logging_steps=1)
    trainer = GRPOTrainer(model, reward, args, data, processing_class=tok, anchor=anchor)
    trainer.train()
    logs = [h for h in trainer.state.log_history if "loss" in h]
    assert len(logs) == 4
    keys = ("anchor/overlap", "anchor/overlap_min", "anchor/lambda", "routing/mean/base_forward_topk_overlap")
    assert all(k in h for h in logs for k in keys)
    lam, armed = 1.0, False  # λ₀, held until the overlap first falls below the target
    for h in logs:
        m = h["anchor/overlap"]
        armed = armed or m < target
        if armed:
            lam = min(max(lam * math.exp(0.1 * min(max((target - m) / (1 - target), -1.0), 1.0)), 1e-3), 1e3)
        assert h["anchor/lambda"] == pytest.approx(lam, rel=1e-12)
    assert logs[0]["anchor/overlap"] == 1.0 and armed and lam > 1.0  # the base at update 0, then it moved
    anchor.remove()
    trainer.replay.remove()


def test_at_learning_rate_zero_each_replay_mode_reads_what_docs_rl_md_says(tok, save_tiny, tmp_path):
    """Identical weights and rollouts in every mode (learning rate 0, one seed). Off, R2 and PR2 train the batch's
    first update on the router's own routing: their flip rate, routing-kd term and base-forward overlap are one
    figure each (the term 0 and the overlap 1: the policy is the reference). R3 trains it on the rollout's routes:
    it logs the share of choices it overrides instead of a flip rate, and every token's routing agrees with the
    rollout's (no `_disagreed` gap) (docs/rl.md, "What each figure reads under each mode")."""
    from rpb.monitor import attach_monitor
    from rpb.testing.models import build_tiny_model, randomize_routers

    # routers of small weights, near-tied choices: rollouts in bfloat16 (training in float32) then route otherwise
    model = build_tiny_model("qwen3_moe", len(tok), seed=0)
    randomize_routers(model, seed=3, scale=0.05)
    model.save_pretrained(tmp_path / "near-ties")
    logs = {}
    for mode in ("off", "R2", "PR2", "R3"):
        settings = dict(beta=0.1, learning_rate=0.0, replay=mode, logging_steps=1, rollout_dtype="bfloat16")
        trainer, anchor = trainer_with(tok, lambda _: tmp_path / "near-ties", tmp_path / mode, "routing-kd", **settings)
        attach_monitor(trainer)
        trainer.train()
        logs[mode] = next(h for h in trainer.state.log_history if "loss" in h)
        anchor.remove()
        trainer.replay.remove()
    flips = {m: logs[m].get("routing/rollout_flip_rate") for m in logs}
    assert flips["off"] > 0 and flips["off"] == flips["R2"] == flips["PR2"] and flips["R3"] is None
    assert logs["R3"]["routing/rollout_override_rate"] > 0
    assert not any("routing/rollout_override_rate" in logs[m] for m in ("off", "R2", "PR2"))
    assert (
        "routing/rollout_logp_gap_disagreed" in logs["off"] and "routing/rollout_logp_gap_disagreed" not in logs["R3"]
    )
    assert logs["R3"]["routing/rollout_logp_gap_agreed"] == logs["R3"]["routing/rollout_logp_gap"]
    for mode in ("off", "R2", "PR2"):
        assert logs[mode]["anchor/routing-kd"] == pytest.approx(0.0, abs=1e-7), mode
        assert logs[mode]["routing/mean/base_forward_topk_overlap"] == 1.0, mode
    # R3's own choice is read on hidden states the rollout's routes made: the term and the overlap may leave their
    # values at the base wherever an override upstream moves a later router's input (docs/rl.md); at this size none
    # does, and both read as the free forward's
    for key in ("anchor/routing-kd", "routing/mean/base_forward_topk_overlap"):
        assert logs["R3"][key] == pytest.approx(logs["off"][key], abs=1e-6), key
