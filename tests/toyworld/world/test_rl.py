"""The toy world's reinforcement-learning cell on a tiny Moonlight-shaped start: held-out prompts, the exact-match
reward against hand values, and a cell of each kind of arm recording what it ran."""

from __future__ import annotations

import json

import pytest
from transformers import AutoModelForCausalLM

from rpb.collect import collect
from rpb.toyworld.grids.rl import RL_ARMS
from rpb.toyworld.grids.rl_stale import GRID as STALE_GRID
from rpb.toyworld.world.post import write_rows
from rpb.toyworld.world.rl import RLRecipe, exact_match_reward, rl_prompts, train_rl_cell
from rpb.toyworld.world.tasks import Task, sample

pytestmark = pytest.mark.usefixtures("one_thread")

TINY = RLRecipe(prompts=12, prompt_seed=0, max_steps=2, group_size=2, prompts_per_step=2, steps_per_generation=2,
                max_completion_length=4)  # fmt: skip


def test_the_prompts_are_the_training_split_without_the_sft_rows(tmp_path):
    sft = write_rows(sample("math_post", 5, seed=0), tmp_path / "sft.jsonl")
    prompts = rl_prompts("math_post", sft, TINY)
    taken = {t.question for t in sample("math_post", 5, seed=0)}
    assert [t.question for t in prompts] == [t.question for t in sample("math_post", 12, seed=0)
                                             if t.question not in taken]  # fmt: skip
    assert len(prompts) == 7  # the same seed draws the sft rows first: 12 - 5


def test_the_reward_is_exact_match_with_the_rows_reference():
    tasks = [Task("math_post", "1+2+3=", "6"), Task("math_post", "2+2+2=", "6"), Task("math_post", "9+0+1=", "01")]
    reward = exact_match_reward(tasks)
    assert reward(["6", " 6\n", "10"], rpb_sample_index=[0, 1, 2]) == [1.0, 1.0, 0.0]
    assert reward([[{"role": "assistant", "content": "01"}]], rpb_sample_index=[2]) == [1.0]


@pytest.mark.parametrize(
    "grid, label",
    [("rl", "grpo"), ("rl", "grpo + R3"), ("rl", "gspo"), ("rl", "grpo + rpb"), ("rl-stale", "grpo + PR2"),
     ("rl-stale", "grpo + beta + routing-kd")],
)  # fmt: skip
def test_a_cell_of_each_kind_trains_saves_and_records_what_it_ran(grid, label, save_tiny, tmp_path):
    arm = next(a for a in (RL_ARMS if grid == "rl" else STALE_GRID.arms) if a.label == label)
    start = save_tiny("moonlight")
    tasks = sample("math_post", 8, seed=3)
    prompts = write_rows(tasks, tmp_path / "prompts.jsonl")
    prior = None
    if arm.method == "rpb":
        prior = tmp_path / "prior.safetensors"
        collect(str(start), prompts, prior, top_k=2, max_seq_len=128, progress=False)
    seen = []  # the grid's collapse rule is judged on the cell's own per-step reward and loss

    def rule(reward, loss):
        seen.append((reward, loss))
        return True

    record = train_rl_cell(start, prompts, tasks, tmp_path / "cell", arm, 42, TINY, prior=prior,
                           anchor={"beta": 1.0} if arm.method == "rpb" else {"lambda_": 1.0} if arm.method ==
                           "routing-kd" else None, collapsed=rule)  # fmt: skip
    assert len(record["loss"]) == TINY.max_steps
    assert record["settings"]["router_aux_loss_coef"] == 0.0
    assert record["settings"]["replay"] == arm.replay and record["settings"]["rollout_dtype"] == "bfloat16"
    for key, value in arm.trl:
        assert record["settings"][key] == value
    assert record["reward"][0] is not None and 0.0 <= record["reward"][0] <= 1.0
    # R3 logs the choices it overrides, never a flip rate (docs/rl.md): each cell records the figure its mode logs
    logged, absent = ("rollout_override_rate", "rollout_flip_rate") if arm.replay == "R3" else (
        "rollout_flip_rate", "rollout_override_rate")  # fmt: skip
    assert record[logged][0] is not None and set(record[absent]) == {None}
    present = [v for v in record[logged] if v is not None]
    summary = {"rollout_flip_rate": "flip_rate", "rollout_override_rate": "override_rate"}
    assert record["summary"][summary[logged]] == pytest.approx(sum(present) / len(present))
    assert summary[absent] not in record["summary"]
    assert seen == [(record["reward"], record["loss"])] and record["summary"]["collapsed"] is True
    assert len(record["logp_gap"]) == TINY.max_steps
    # the stale mismatch at each later update index of a generation batch (here one: 2 updates a batch)
    assert set(record["stale_mismatch_by_update"]) == {str(i) for i in range(1, TINY.steps_per_generation)}
    assert record["summary"]["stale_mismatch"] == pytest.approx(
        sum(v for v in record["stale_mismatch"] if v is not None) / sum(v is not None for v in record["stale_mismatch"])
    )
    json.dumps(record)  # a cell's record is written as JSON
    AutoModelForCausalLM.from_pretrained(tmp_path / "cell" / "model")
