"""The shipped tool-loop recipe (examples/trl/grpo_tools.py) end to end on the Qwen3-MoE replica: TRL accepts its
template, some rollouts call the tool (made to, by a logits processor of the test's own: a random model would
not), and under R3 every training forward's experts are the rollout's routes at every routed position, the tool's
result turns included, compared through hooks of the test's own."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest
import torch

from tests.integrations.trl.test_generation_paths import batches_seen, routes_by_row
from tests.integrations.trl.tools import make_rollouts_call, watch_policy_forwards

pytestmark = pytest.mark.usefixtures("one_thread")
EXAMPLE = Path(__file__).resolve().parents[3] / "examples" / "trl" / "grpo_tools.py"


def test_the_tool_recipe_trains_with_r3_through_the_tool_turns(tmp_path, capsys):
    spec = importlib.util.spec_from_file_location("grpo_tools_example", EXAMPLE)
    example = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(example)
    args = example.parse_args(["--output-dir", str(tmp_path), "--max-steps", "1", "--max-completion-length", "200"])
    trainer, anchor = example.build(args)
    make_rollouts_call(trainer.model, trainer.processing_class, rows=[0, 2])
    seen = batches_seen(trainer)
    forwards, handles = watch_policy_forwards(trainer.model, trainer.replay.layers)
    trainer.train()
    for h in handles:
        h.remove()
    log = next(h for h in trainer.state.log_history if "loss" in h)
    assert log["tools/call_frequency"] > 0 and "routing/rollout_override_rate" in log
    tool_positions = sum(int((inputs["tool_mask"] == 0).sum()) for inputs in seen)
    assert tool_positions > 0, "no tool result was appended: the tool turns were not reached"
    rollout = routes_by_row(seen, "rpb_rollout_routes")
    tool_rows = {}  # each rollout's token row -> its positions that hold a tool's result
    for inputs in seen:
        ids = torch.cat([inputs["prompt_ids"], inputs["completion_ids"]], dim=1)
        tools = torch.cat([torch.zeros_like(inputs["prompt_mask"]), inputs["tool_mask"] == 0], dim=1).bool()
        tool_rows |= {tuple(ids[b].tolist()): tools[b] for b in range(ids.shape[0])}
    compared = tool_compared = 0
    for f in (f for f in forwards if f["scores"] and f["grad"]):
        for b in range(f["ids"].shape[0]):
            key = tuple(f["ids"][b].tolist())
            routes_SLK, tool_S = rollout[key], tool_rows[key]
            has_S = (routes_SLK >= 0).all(-1).all(-1)
            for pos, got_BSK in f["experts"].items():
                got, rec = got_BSK[b][has_S].sort(-1).values, routes_SLK[has_S][:, pos].sort(-1).values
                assert torch.equal(got, rec.to(got.dtype)), (b, pos)
                compared += int(has_S.sum())
                tool_compared += int((has_S & tool_S).sum())
    assert compared > 0 and tool_compared > 0  # the tool's result tokens were replayed too
    trainer.replay.remove()
    anchor.remove()
    assert example.tool_reward([[{"role": "assistant", "content": ""}, {"role": "tool", "content": "3"},
                                 {"role": "assistant", "content": "It is 3."}]]) == [1.0]  # fmt: skip
