"""Every generation path TRL's GRPOTrainer takes, on the Qwen3-MoE and DeepSeek-V3 (Moonlight) replicas: with the
KV cache, without it, with chunked prefill, and through TRL's tool loop (a tool called, its result appended, the
rollout generated again). At learning rate 0 in float32 the recorded routes must be each token's own routing
(a full forward read by a hook of the test's own), and every forward that feeds the loss or the importance ratio
(TRL's old-log-prob forward included) must give the experts module exactly the routes it replays."""

from __future__ import annotations

import pytest
import torch

from rpb.anchors import AnchorConfig, install_anchor
from rpb.integrations.trl import GRPOConfig, GRPOTrainer
from rpb.testing.models import build_tiny_model
from tests.integrations.trl.test_grpo import PROMPTS, full_forward_topk, reward
from tests.integrations.trl.tools import (
    add,
    make_rollouts_call,
    qwen3_char_tokenizer,
    tool_dataset,
    watch_policy_forwards,
)

pytestmark = pytest.mark.usefixtures("one_thread")

#: path -> (generate's keywords, whether TRL's tool loop runs)
PATHS = {
    "cache": ({}, False),
    "no-cache": ({"use_cache": False}, False),
    "chunked-prefill": ({"prefill_chunk_size": 3}, False),
    "tools": ({}, True),
}
ARCHS = ["qwen3_moe", "moonlight"]


def path_trainer(arch, path, tok, tmp_path, **overrides):
    kwargs, tools = PATHS[path]
    if tools:
        tok = qwen3_char_tokenizer()
    model = build_tiny_model(arch, len(tok), seed=0).train()
    anchor = install_anchor(model, AnchorConfig(method="sft"))
    extra = {}
    if tools:
        make_rollouts_call(model, tok, rows=[0, 2])
        data, extra["tools"] = tool_dataset(), [add]
    else:
        import datasets

        data = datasets.Dataset.from_list([{"prompt": p} for p in PROMPTS])
    settings = dict(output_dir=str(tmp_path), max_steps=2, per_device_train_batch_size=4, num_generations=4,
                    max_completion_length=160 if tools else 6, learning_rate=0.0, logging_steps=1, save_strategy="no",
                    report_to=[], use_cpu=True, seed=7, disable_tqdm=True, beta=0.0, bf16=False,
                    generation_kwargs=kwargs or None, steps_per_generation=2, num_iterations=2,
                    gradient_accumulation_steps=1)  # fmt: skip
    args = GRPOConfig(**{**settings, **overrides})
    trainer = GRPOTrainer(model, reward, args, data, processing_class=tok, anchor=anchor, **extra)
    return trainer, anchor


def batches_seen(trainer) -> list[dict]:
    seen = []
    prepare = trainer._prepare_inputs
    trainer._prepare_inputs = lambda batch: seen.append(prepare(batch)) or seen[-1]
    return seen


def routes_by_row(seen: list[dict], key: str) -> dict[tuple, torch.Tensor]:
    """Each rollout's padded token row -> the routes the batch carries for it under ``key``."""
    out = {}
    for inputs in seen:
        ids = torch.cat([inputs["prompt_ids"], inputs["completion_ids"]], dim=1)
        for b in range(ids.shape[0]):
            out[tuple(ids[b].tolist())] = inputs[key][b]
    return out


@pytest.mark.parametrize("path", PATHS)
@pytest.mark.parametrize("arch", ARCHS)
def test_the_routes_are_each_tokens_own_on_every_generation_path(arch, path, tok, tmp_path):
    trainer, anchor = path_trainer(arch, path, tok, tmp_path, replay="R3")
    seen = batches_seen(trainer)
    trainer.train()
    if PATHS[path][1]:  # the tool loop ran: some completions hold a tool's result
        assert any((inputs["tool_mask"] == 0).any() for inputs in seen)
    checked = 0
    for inputs in seen:
        routes = inputs["rpb_rollout_routes"]
        ids = torch.cat([inputs["prompt_ids"], inputs["completion_ids"]], dim=1)
        mask = torch.cat([inputs["prompt_mask"], inputs["completion_mask"]], dim=1)
        own = full_forward_topk(trainer.model, trainer.replay.layers, ids, mask)
        has = (routes >= 0).all(-1).all(-1)
        assert int(has.sum()) == int(mask.sum()) - mask.shape[0]  # every token but each rollout's last
        assert torch.equal(routes[has].sort(-1).values, own[has].sort(-1).values)
        checked += int(has.sum())
    assert checked > 0
    logs = [h for h in trainer.state.log_history if "routing/rollout_override_rate" in h]  # R3's (docs/rl.md)
    assert logs and all(h["routing/rollout_override_rate"] == 0.0 for h in logs)
    assert all(h["routing/rollout_logp_gap"] < 1e-5 for h in logs)
    anchor.remove()


@pytest.mark.parametrize("replay", ["R3", "R2"])
@pytest.mark.parametrize("path", ["cache", "tools"])
@pytest.mark.parametrize("arch", ARCHS)
def test_every_forward_that_feeds_the_loss_gets_the_replayed_experts(arch, path, replay, tok, tmp_path):
    """R3: the old-log-prob forward and every training forward get the rollout's routes; R2: every training forward
    gets the old-log-prob forward's own routing. Checked at every position that carries a route. (Once routes
    are placed, which the test above checks on every path, replaying them is the same on every path: the cache
    and the tool loop's several generate calls stand for them.)"""
    trainer, anchor = path_trainer(arch, path, tok, tmp_path, replay=replay)
    assert trainer._trl_scores_old_logps()  # accumulation 1 against a cycle of 4: TRL scores old log-probs
    seen = batches_seen(trainer)
    forwards, handles = watch_policy_forwards(trainer.model, trainer.replay.layers)
    trainer.train()
    for h in handles:
        h.remove()
    want = routes_by_row(seen, "rpb_rollout_routes" if replay == "R3" else "rpb_first_routes")
    scored = [f for f in forwards if f["scores"]]
    # per generation batch: one old-log-prob forward (no gradients), then the training forwards
    assert any(not f["grad"] for f in scored) and any(f["grad"] for f in scored)
    compared = 0
    for f in scored:
        if replay == "R2" and not f["grad"]:
            continue  # R2's first forward routes freely: its routing is what the later ones replay
        for b in range(f["ids"].shape[0]):
            routes_SLK = want[tuple(f["ids"][b].tolist())]
            has_S = (routes_SLK >= 0).all(-1).all(-1)
            for pos, got_BSK in f["experts"].items():
                got, rec = got_BSK[b][has_S].sort(-1).values, routes_SLK[has_S][:, pos].sort(-1).values
                assert torch.equal(got, rec.to(got.dtype)), (b, pos, f["grad"])
                compared += int(has_S.sum())
    assert compared > 0
    anchor.remove()
