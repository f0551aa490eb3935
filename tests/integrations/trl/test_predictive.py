"""PR2 and the stale figure in rpb's GRPOTrainer (TRL's, the installed release) on a tiny Qwen3-MoE:

* ``routing/stale_mismatch/update_<i>`` against a hand count at every update index, for off, R2, R3 and PR2, on
  Qwen3-MoE and DeepSeek-V3 (Moonlight): the
  live routers' own top-k (read by hooks of the test's own, before any replacement) against the routes the mode
  replays (``off``: the first training-side forward's own), over completion tokens x MoE layers;
* PR2's predictor learns in a batch's later updates only, and a PR2 run resumed from a checkpoint equals the
  uninterrupted one (its predictor restored, never in the model's saved weights);
* the refusals."""

from __future__ import annotations

from pathlib import Path

import datasets
import pytest
import torch
from safetensors.torch import load_file
from transformers import TrainerCallback

from rpb.adapters import find_moe_layers, get_adapter
from rpb.anchors import AnchorConfig, install_anchor
from rpb.errors import ConfigError
from rpb.integrations.trl import GRPOTrainer
from rpb.integrations.trl.predictive import PREDICTOR_FILE
from rpb.testing.models import build_tiny_model, randomize_routers
from tests.integrations.trl.test_grpo import PROMPTS, grpo_args, reward, trainer_for

pytestmark = pytest.mark.usefixtures("one_thread")

#: which batch-dict routes each mode's stale figure compares the live choice with
AGAINST = {"off": "rpb_first_routes", "R2": "rpb_first_routes", "R3": "rpb_rollout_routes", "PR2": "rpb_pr2_routes"}
ITERATIONS = 3  # one micro-batch per step: update index = step % 3


class Watch:
    """Each training micro-batch's inputs and the routers' own top-k in its training forward; the predictor's
    weights after each step."""

    def __init__(self, trainer):
        self.steps, self.predictor, self.handles = [], [], []
        prepare = trainer._prepare_inputs

        def preparing(batch):
            inputs = prepare(batch)
            self.steps.append({"inputs": inputs, "live": {}})
            return inputs

        trainer._prepare_inputs = preparing
        watch = self

        class AfterTheOptimizer(TrainerCallback):
            def on_step_end(self, args, state, control, **kwargs):
                if trainer.pr2 is not None:
                    watch.predictor.append([w.detach().clone() for w in trainer.pr2.parameters()])

        trainer.add_callback(AfterTheOptimizer())
        for pos, m in enumerate(trainer.replay.layers):
            self.handles.append(m.router.register_forward_hook(self._live(pos), prepend=True))

    def _live(self, pos):
        def hook(module, args, out):
            if module.training and torch.is_grad_enabled():
                self.steps[-1]["live"][pos] = out[2].detach().clone()

        return hook

    def remove(self):
        for h in self.handles:
            h.remove()


def hand_stale(step: dict, key: str) -> tuple[int, int]:
    """(top-k sets that differ, completion tokens x layers) of one micro-batch against its ``key`` routes, counted
    here."""
    inputs, live = step["inputs"], step["live"]
    against = inputs[key]
    B, S, L, _ = against.shape
    P = inputs["prompt_ids"].shape[1]
    differ = count = 0
    for b in range(B):
        for s in range(P, S):
            if not inputs["completion_mask"][b, s - P] or (against[b, s] < 0).any():
                continue
            for pos in range(L):
                mine = sorted(live[pos].reshape(B, S, -1)[b, s].tolist())
                differ += mine != sorted(against[b, s, pos].tolist())
                count += 1
    return differ, count


@pytest.mark.parametrize("arch", ["qwen3_moe", "moonlight"])
@pytest.mark.parametrize("replay", list(AGAINST))
def test_the_stale_figure_is_the_hand_count_at_every_update_index(replay, arch, tok, tmp_path):
    trainer, anchor = trainer_for(tok, tmp_path, "sft", arch=arch, replay=replay, num_iterations=ITERATIONS,
                                  max_steps=6, learning_rate=2e-2, rollout_dtype="bfloat16")  # fmt: skip
    randomize_routers(trainer.model, seed=5, scale=1.0)  # close scores: bf16 rollouts flip some choices
    watch = Watch(trainer)
    trainer.train()
    watch.remove()
    logs = [h for h in trainer.state.log_history if "loss" in h]
    assert len(logs) == len(watch.steps) == 6
    seen_stale, rollout_differs = 0.0, 0
    for step, (entry, log) in enumerate(zip(watch.steps, logs, strict=True)):
        i = step % ITERATIONS
        if i == 0:  # the policy is the one that generated the batch: nothing is stale
            assert not any(k.startswith("routing/stale_mismatch") for k in log), step
            continue
        differ, count = hand_stale(entry, AGAINST[replay])
        assert count > 0
        assert log[f"routing/stale_mismatch/update_{i}"] == pytest.approx(differ / count, abs=1e-12), (step, i)
        assert log["routing/stale_mismatch"] == pytest.approx(differ / count, abs=1e-12)
        assert not any(k.startswith("routing/stale_mismatch/update_") and k != f"routing/stale_mismatch/update_{i}"
                       for k in log)  # fmt: skip
        seen_stale += differ / count
        inputs = entry["inputs"]
        rollout_differs += int((inputs["rpb_rollout_routes"] != inputs["rpb_first_routes"]).any(-1).any(-1).sum())
    assert seen_stale > 0, "the routing never went stale: the figure was never shown to count anything"
    if replay == "off":  # the figure reads the first forward, not the rollout: here the two differ
        assert rollout_differs > 0
    if replay == "PR2":  # judged against R2 on its own trajectory: the first forward's own routes, counted here
        for step, (entry, log) in enumerate(zip(watch.steps, logs, strict=True)):
            inputs = entry["inputs"]
            if step % ITERATIONS:
                differ, count = hand_stale(entry, "rpb_first_routes")
                assert log["routing/stale_mismatch_r2"] == pytest.approx(differ / count, abs=1e-12), step
                assert log[f"routing/stale_mismatch_r2/update_{step % ITERATIONS}"] == log["routing/stale_mismatch_r2"]
                continue
            as_live = {pos: inputs["rpb_pr2_routes"][:, :, pos].reshape(-1, inputs["rpb_pr2_routes"].shape[-1])
                       for pos in range(inputs["rpb_pr2_routes"].shape[2])}  # fmt: skip
            differ, count = hand_stale({"inputs": inputs, "live": as_live}, "rpb_first_routes")
            assert log["pr2/changed_share"] == pytest.approx(differ / count, abs=1e-12), step
            assert "routing/stale_mismatch_r2" not in log
        assert any(log["pr2/changed_share"] > 0 for log in logs[ITERATIONS::ITERATIONS]), "the predictor changed none"
        for step, log in enumerate(logs):  # the predictor learns from a batch's second update on, never in its first
            assert ("pr2/loss" in log) == (step % ITERATIONS >= 1), step
            before = watch.predictor[step - 1] if step else [torch.zeros_like(w) for w in watch.predictor[0]]
            if step % ITERATIONS == 0:
                assert all(torch.equal(a, b) for a, b in zip(before, watch.predictor[step], strict=True)), step
        assert any(w.any() for w in watch.predictor[-1]), "the predictor never moved: nothing was shown"
    anchor.remove()
    trainer.replay.remove()


# ---- resume ----------------------------------------------------------------------------------------------


def pr2_run(tok, out: Path, resume: str | None = None):
    trainer, anchor = trainer_for(tok, out, "sft", replay="PR2", num_iterations=2, max_steps=4, learning_rate=2e-2,
                                  save_strategy="steps", save_steps=2, pr2_lr_scale=100.0)  # fmt: skip
    randomize_routers(trainer.model, seed=5, scale=1.0)
    trainer.train(resume_from_checkpoint=resume)
    anchor.remove()
    trainer.replay.remove()
    return trainer


def test_a_pr2_run_resumed_from_a_checkpoint_equals_the_uninterrupted_one(tok, tmp_path):
    whole = pr2_run(tok, tmp_path / "whole")
    checkpoint = tmp_path / "whole" / "checkpoint-2"
    saved = load_file(str(checkpoint / "model.safetensors"))
    assert not any("linears" in k or "pr2" in k for k in saved), "the predictor leaked into the model's weights"
    predictor = load_file(str(checkpoint / PREDICTOR_FILE))
    assert any(w.any() for w in predictor.values()), "a zero predictor at the checkpoint: its restore shows nothing"
    resumed = pr2_run(tok, tmp_path / "resumed", resume=str(checkpoint))
    for (name, a), b in zip(whole.model.state_dict().items(), resumed.model.state_dict().values(), strict=True):
        assert torch.equal(a, b), name
    for a, b in zip(whole.pr2.parameters(), resumed.pr2.parameters(), strict=True):
        assert torch.equal(a, b)

    (checkpoint / PREDICTOR_FILE).unlink()
    with pytest.raises(ConfigError, match=f"holds no {PREDICTOR_FILE}"):
        pr2_run(tok, tmp_path / "again", resume=str(checkpoint))


# ---- refusals -------------------------------------------------------------------------------------------


def test_pr2_with_a_prior_reading_method_is_refused_by_name(tok, tmp_path):
    model = build_tiny_model("qwen3_moe", len(tok), seed=0)
    E, L = model.config.num_experts, len(find_moe_layers(model, get_adapter("qwen3_moe")))
    anchor = install_anchor(model, AnchorConfig(method="rpb", beta=1.0), prior=torch.full((6, 2, L, E), 1.0 / E))
    data = datasets.Dataset.from_list([{"prompt": p} for p in PROMPTS])
    with pytest.raises(ConfigError, match=r"anchor.method=rpb with replay='PR2'.*use R2"):
        GRPOTrainer(model, reward, grpo_args(tmp_path, replay="PR2"), data, processing_class=tok, anchor=anchor)
    anchor.remove()


# ---- the predictor's learning rate, and what the first forward records under PR2 -------------------------------


def test_the_predictors_optimizer_group_has_the_scaled_learning_rate_and_no_weight_decay(tok, tmp_path):
    """docs/rl.md: the predictor learns at learning_rate x pr2_lr_scale (the reference's alpha), without weight
    decay; the model's own groups keep the run's learning rate."""
    trainer, anchor = trainer_for(tok, tmp_path, "sft", replay="PR2", learning_rate=2e-2, pr2_lr_scale=7.0,
                                  weight_decay=0.1)  # fmt: skip
    optimizer = trainer.create_optimizer()
    mine = {id(p) for p in trainer.pr2.parameters()}
    groups = [g for g in optimizer.param_groups if {id(p) for p in g["params"]} & mine]
    assert len(groups) == 1 and {id(p) for p in groups[0]["params"]} == mine
    assert groups[0]["lr"] == pytest.approx(2e-2 * 7.0, rel=1e-12) and groups[0]["weight_decay"] == 0.0
    others = [g for g in optimizer.param_groups if g is not groups[0]]
    assert others and all(g["lr"] == pytest.approx(2e-2, rel=1e-12) for g in others)
    anchor.remove()
    trainer.replay.remove()


class FirstForwards:
    """Each generation batch's first training-side forward: the routers' own top-k, read by hooks of the test's own
    before any replacement, and the batch dict rpb hands TRL (before TRL shuffles it)."""

    def __init__(self, trainer):
        self.own: list[list[list[torch.Tensor]]] = []  # batch -> layer -> the chunks' [tokens, K]
        self.batches: list[dict] = []
        self.shapes: list[tuple[int, int]] = []
        self.inside = False
        first, generate = trainer._first_forward, trainer._generate_and_score_completions

        def first_forward(model, input_ids, *a, **kw):
            self.own.append([[] for _ in trainer.replay.layers])
            self.shapes.append(tuple(input_ids.shape))
            self.inside = True
            try:
                return first(model, input_ids, *a, **kw)
            finally:
                self.inside = False

        def generating(inputs):
            output = generate(inputs)
            if trainer.model.training:
                self.batches.append({k: v.clone() for k, v in output.items() if isinstance(v, torch.Tensor)})
            return output

        trainer._first_forward, trainer._generate_and_score_completions = first_forward, generating
        self.handles = [m.router.register_forward_hook(self._read(pos), prepend=True)
                        for pos, m in enumerate(trainer.replay.layers)]  # fmt: skip

    def _read(self, pos):
        def hook(module, args, out):
            if self.inside:
                self.own[-1][pos].append(out[2].detach().clone())

        return hook

    def live(self, i: int) -> dict[int, torch.Tensor]:
        """Batch ``i``'s own top-k per layer, ``[tokens, K]`` over its rows in order (``hand_stale``'s ``live``)."""
        return {pos: torch.cat(chunks) for pos, chunks in enumerate(self.own[i])}

    def own_BSLK(self, i: int) -> torch.Tensor:
        B, S = self.shapes[i]
        return torch.stack([ids.reshape(B, S, -1) for ids in self.live(i).values()], dim=2)

    def remove(self):
        for h in self.handles:
            h.remove()


def test_under_pr2_the_first_routes_and_the_flip_rate_read_the_routers_own_choice(tok, tmp_path):
    """PR2's first forward routes by the predictor, but what it records as the batch's first routes, and what the
    rollout flip rate compares the rollout with, is the routers' own choice. Two generation batches of two updates
    each: in the second the predictor has moved, so its choice and the routers' own differ."""
    trainer, anchor = trainer_for(tok, tmp_path, "sft", replay="PR2", num_iterations=2, max_steps=3,
                                  learning_rate=2e-2, pr2_lr_scale=100.0, rollout_dtype="bfloat16")  # fmt: skip
    randomize_routers(trainer.model, seed=5, scale=1.0)  # close scores: bf16 rollouts flip some choices
    watch = FirstForwards(trainer)
    trainer.train()
    watch.remove()
    logs = [h for h in trainer.state.log_history if "loss" in h]
    assert len(watch.batches) == len(watch.own) == 2 and len(logs) == 3
    flips_seen = 0
    for i, step in ((0, 0), (1, 2)):  # each batch's first update is its step's
        batch, own = watch.batches[i], watch.own_BSLK(i).sort(-1).values
        first = batch["rpb_first_routes"].sort(-1).values.to(own.dtype)
        assert torch.equal(first, own), f"batch {i}: the first routes are not the routers' own top-k"
        if i == 1:  # the predictor moved: its routes are not the routers' own, so the case tells the two apart
            assert not torch.equal(batch["rpb_pr2_routes"].sort(-1).values.to(own.dtype), own)
        # the rollout against the routers' own choice, over completion tokens x layers, counted here
        differ, count = hand_stale({"inputs": batch, "live": watch.live(i)}, "rpb_rollout_routes")
        assert count > 0
        assert logs[step]["routing/rollout_flip_rate"] == pytest.approx(differ / count, abs=1e-12), i
        flips_seen += differ
    assert flips_seen > 0, "the rollout never flipped: the figure was never shown to count anything"
    anchor.remove()
    trainer.replay.remove()
