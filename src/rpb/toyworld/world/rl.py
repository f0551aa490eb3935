"""One reinforcement-learning cell of the toy world: GRPO from an ``sft`` start on held-out
prompts of a post-training set, rewarded by exact match, through rpb's ``GRPOTrainer`` (docs/rl.md).

* **Prompts** (``rl_prompts``): questions of the set's training split that the ``sft`` data file does not hold
  (and so no test or validation part either: those are other splits), each with its reference answer, written
  in rpb's data format so that ``rpb collect`` gives the prior ``rpb`` reads (``prepare_grpo``).
* **Reward**: 1 for an exact match of the completion with the reference (``tasks.is_correct``), else 0.
* **Precision**: rollouts in bfloat16 (``RLRecipe.rollout_dtype``), training in float32, so the rollout /
  training mismatch an engine makes is real here.
* **Off-policy**: ``steps_per_generation`` updates per generation batch.
* **An arm** (``RLArm``): the anchor, the replay mode and TRL's loss settings it changes.

Every setting of TRL that a cell changes is in its record (``settings``), with TRL's load-balancing
coefficient as the trainer ran it.
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import ClassVar

from rpb.toyworld.world.tasks import Task, is_correct, sample


@dataclass(frozen=True)
class RLRecipe:
    """What every cell of an ``rl`` grid shares."""

    #: held-out prompts drawn (before the sft data's are taken out) and the seed that draws them
    prompts: int = 512
    prompt_seed: int = 7
    max_steps: int = 300
    #: completions per prompt (TRL's ``num_generations``) and prompts per optimizer step
    group_size: int = 8
    prompts_per_step: int = 4
    #: updates per generation batch (TRL's ``steps_per_generation``; accumulation stays 1)
    steps_per_generation: int = 2
    lr: float = 5e-5
    temperature: float = 1.0
    rollout_dtype: str | None = "bfloat16"
    max_completion_length: int = 16
    #: prompt plus completion, in tokens (the prior is collected at the same length: ``rpb`` refuses another)
    max_seq_len: int = 128


@dataclass(frozen=True)
class RLArm:
    label: str
    #: rpb's anchor method (``sft``: none)
    method: str = "sft"
    replay: str = "off"
    #: TRL GRPOConfig fields the arm sets beside the recipe's (GSPO's)
    trl: tuple[tuple[str, object], ...] = ()
    #: what a grid's cell asks of an arm besides its method: no fixed anchor setting (the weight is chosen on
    #: validation) and no arm at ``rpb calibrate``'s beta
    anchor: ClassVar[tuple[tuple[str, float], ...]] = ()
    calibrated: ClassVar[bool] = False

    @property
    def slug(self) -> str:
        """The arm's folder name under ``runs/<set>/``."""
        return self.label.replace(" + ", "+").replace(" ", "")


def rl_prompts(post_set: str, sft_rows: Path, recipe: RLRecipe) -> list[Task]:
    """The set's training-split questions the sft data file does not hold, in drawing order."""
    taken = set()
    for line in Path(sft_rows).read_text().splitlines():
        messages = json.loads(line)["messages"]
        taken.add(next(m["content"] for m in messages if m["role"] == "user"))
    return [t for t in sample(post_set, recipe.prompts, seed=recipe.prompt_seed) if t.question not in taken]


def exact_match_reward(tasks: list[Task]):
    """TRL's reward function: 1.0 where a completion equals its row's reference answer (the row: the dataset's
    ``rpb_sample_index``, the line of the prompts file), else 0.0."""

    def reward(completions, rpb_sample_index, **kwargs) -> list[float]:
        texts = [c[0]["content"] if isinstance(c, list) else c for c in completions]
        return [float(is_correct(tasks[i], text)) for text, i in zip(texts, rpb_sample_index, strict=True)]

    return reward


def train_rl_cell(
    start: Path,
    prompts_jsonl: Path,
    tasks: list[Task],
    out: Path,
    arm: RLArm,
    seed: int,
    recipe: RLRecipe,
    anchor: dict | None = None,
    prior: Path | None = None,
    collapsed: Callable[[list, list], bool] | None = None,
) -> dict:
    """GRPO of ``arm`` from the checkpoint ``start`` on ``prompts_jsonl`` (its rows: ``tasks``); saves the model to
    ``out`` and returns the cell's record: seconds, the per-step reward, flip rate and log-probability gap, and
    every TRL setting the cell changed. ``collapsed(reward, loss)``: the grid's collapse rule, judged on the
    cell's per-step figures (its summary leaves it out without one)."""
    from rpb.anchors import AnchorConfig
    from rpb.integrations.trl import GRPOConfig, GRPOTrainer, prepare_grpo
    from rpb.models import load_causal_lm, load_tokenizer
    from rpb.toyworld.world.post import ROUTER_TRANSFORM

    tokenizer = load_tokenizer(str(start))
    tokenizer.padding_side = "left"
    model = load_causal_lm(str(start), "float32").train()
    config = AnchorConfig(method=arm.method, **({"router_transform": ROUTER_TRANSFORM} | (anchor or {})))
    handle, dataset = prepare_grpo(
        model, tokenizer, str(prompts_jsonl), config, str(prior) if prior else None, max_seq_len=recipe.max_seq_len
    )
    settings = {
        "max_steps": recipe.max_steps,
        "per_device_train_batch_size": recipe.prompts_per_step * recipe.group_size,
        "num_generations": recipe.group_size,
        "steps_per_generation": recipe.steps_per_generation,
        "gradient_accumulation_steps": 1,
        "max_completion_length": recipe.max_completion_length,
        "learning_rate": recipe.lr,
        "temperature": recipe.temperature,
        "beta": 0.0,
        "bf16": False,
        "replay": arm.replay,
        "rollout_dtype": recipe.rollout_dtype,
        **dict(arm.trl),
    }
    fixed = {"logging_steps": 1, "save_strategy": "no", "report_to": [], "use_cpu": True, "disable_tqdm": True}
    args = GRPOConfig(output_dir=str(out / "trl"), seed=seed, **fixed, **settings)
    trainer = GRPOTrainer(model, exact_match_reward(tasks), args, dataset, processing_class=tokenizer, anchor=handle)
    started = time.perf_counter()
    trainer.train()
    seconds = time.perf_counter() - started
    trainer.replay.remove()
    handle.remove()
    model.save_pretrained(out / "model")
    tokenizer.save_pretrained(out / "model")
    logs = [h for h in trainer.state.log_history if "loss" in h]  # one entry per step (logging_steps=1)

    def figure(key: str) -> list:
        return [h.get(key) for h in logs]

    flips, gaps = figure("routing/rollout_flip_rate"), figure("routing/rollout_logp_gap")
    overrides = figure("routing/rollout_override_rate")
    stale = "routing/stale_mismatch/update_"
    updates = sorted({int(k.removeprefix(stale)) for h in logs for k in h if k.startswith(stale)})
    return {
        # the claims' figures (the grid's claims read them): the means over training, and the collapse rule's verdict
        "summary": {
            "logp_gap": _mean(gaps),
            "stale_mismatch": _mean(figure("routing/stale_mismatch")),
        }
        # the free forward's flip rate (not under R3, which logs its override rate: another figure, docs/rl.md)
        | ({"flip_rate": _mean(flips)} if any(v is not None for v in flips) else {})
        | ({"override_rate": _mean(overrides)} if any(v is not None for v in overrides) else {})
        # PR2 judged against R2 on its own trajectory (docs/rl.md): where the run logs them
        | {key: _mean(figure(name)) for key, name in PR2_FIGURES.items() if any(v is not None for v in figure(name))}
        | ({"collapsed": collapsed(figure("reward"), figure("loss"))} if collapsed else {}),
        "arm": asdict(arm) | {"trl": dict(arm.trl)},
        "seed": seed,
        "settings": settings | {"router_aux_loss_coef": trainer.router_aux_loss_coef},
        "seconds": seconds,
        "reward": figure("reward"),
        "rollout_flip_rate": flips,
        "rollout_override_rate": overrides,
        "stale_mismatch": figure("routing/stale_mismatch"),
        # the mismatch's growth with each reuse of a generation batch: its mean over training at each update index
        "stale_mismatch_by_update": {str(i): _mean(figure(f"{stale}{i}")) for i in updates},
        "logp_gap": figure("routing/rollout_logp_gap"),
        "logp_gap_agreed": figure("routing/rollout_logp_gap_agreed"),
        "logp_gap_disagreed": figure("routing/rollout_logp_gap_disagreed"),
        "loss": figure("loss"),
    }


#: PR2's within-run figures, as a cell's summary names them
PR2_FIGURES = {"stale_mismatch_r2": "routing/stale_mismatch_r2", "pr2_changed_share": "pr2/changed_share"}


def _mean(values: list) -> float:
    """The mean of the steps that logged a value (NaN if none did)."""
    present = [v for v in values if v is not None]
    return sum(present) / len(present) if present else float("nan")
