"""TRL's ``GRPOTrainer`` with rpb's loss anchors, routing replay and the rollout-vs-training mismatch made visible:
``from rpb.integrations.trl import GRPOConfig, GRPOTrainer`` (docs/rl.md).

Shape legend: B = completions of a batch, P / C = its padded prompt / completion lengths, S = P + C,
L = MoE layers, K = top-k.

What this changes about TRL, and why:

* **No native load-balancing loss, in any mode.** TRL adds the model config's own (``router_aux_loss_coef``
  None) whenever the config declares one; rpb sets it to 0.0 (said once) and refuses any other value. ``lbl``
  is rpb's own term, the one load-balancing term of a run (TRL's cannot run on DeepSeek-V3 or GLM, whose
  configs lack what it reads).
* **Anchors over the completion tokens.** ``kl-to-base``, ``logit-l2`` and ``lbl`` are averaged over the
  completion tokens with the weights GRPO's ``loss_type`` gives its own per-token loss (``scaling``);
  ``router-l2`` is added once per optimizer step; ``router-freeze`` has no term.
* **RPB** (and its controls) with a dataset from ``prepare_grpo``: prompt tokens read their row's prior as rpb
  labels them, completion tokens the row's A prior (``rl_prior`` says why); the bias applies in the training
  forward and the old-log-prob forward, never in generation or the reference model. With ``R3``: refused.
* **Routing replay** (``GRPOConfig.replay``; ``rpb.replay``): ``R3`` replays each rollout's routes, recorded as
  ``generate`` made them; ``R2`` replays the first training-side forward's own routing (the old-log-prob forward,
  forced on) in the later updates of its batch; ``PR2`` replays routes that forward chose with a learned
  predictor of the router's drift (``predictive``); ``off`` replays nothing. The routes travel in the batch dict
  (``rpb_rollout_routes`` / ``rpb_first_routes`` / ``rpb_pr2_routes``), through TRL's shuffling and splitting.
  The reference model (``beta`` > 0) routes freely: it stands for the base as deployed.
* **Mismatch figures** each logging step: ``routing/rollout_flip_rate`` (rollout against the first training-side
  forward's own choice), ``routing/stale_mismatch`` (in a batch's updates after its first, the live routers'
  choice against the routes the mode replays, ``off`` against the first forward's own; also per update index,
  ``routing/stale_mismatch/update_<i>``), and, in a batch's first update, the log-probability gap over completion
  tokens whose routing agreed in every layer and over the rest (``routing/rollout_logp_gap``, ``_agreed``,
  ``_disagreed``).
* **Precision, said at construction**: TRL's ``bf16`` (its default) runs generation *and* the training forwards
  under bfloat16 autocast; ``rollout_dtype="bfloat16"`` with ``bf16=False`` generates under bfloat16 autocast
  against float32 training forwards, an engine's precision gap on the CPU; ``rollout_dtype`` with ``bf16=True``
  would change nothing and is refused.
* **Evaluation routes freely**: no recording, no replay, no bias in ``evaluate()``'s forwards.
* **routing-kd** reads the reference model's routing of each rollout where ``beta`` > 0 (no forward added), else
  its own base forward; ``output-kd`` is TRL's ``beta``, refused (``base_routing``).
"""

from __future__ import annotations

import contextlib
import inspect
import logging
from dataclasses import dataclass, field

import torch
import trl
from trl.trainer.utils import split_tensor_dict

from rpb.anchors import AnchorConfig, install_anchor
from rpb.errors import ConfigError
from rpb.integrations.trl.base_routing import (
    BASE_ROUTING,
    BaseRoutingCapture,
    adapters_disabled,
    step_routing,
    teacher_problems,
)
from rpb.integrations.trl.generation import GenerationState
from rpb.integrations.trl.grpo_checks import config_problems, trainer_problems
from rpb.integrations.trl.predictive import PR2_INPUTS, PR2_LOGITS, PR2_ROUTES, PredictiveReplay
from rpb.integrations.trl.rl_prior import batch_labels
from rpb.integrations.trl.rollouts import RolloutRoutes
from rpb.integrations.trl.scaling import token_weights_BC
from rpb.integrations.trl.sft import hold_native_aux_off
from rpb.observe.hooks import on_model_inputs
from rpb.replay import RouteReplay
from rpb.train.hold import HoldingTrainer

logger = logging.getLogger(__name__)

#: what TRL's forward takes beside the tokens (images and their fields): the forced R2 forward passes them on
_FORWARD_FIELDS = tuple(
    name
    for name in inspect.signature(trl.GRPOTrainer._get_per_token_logps_and_entropies).parameters
    if name not in ("self", "model", "input_ids", "attention_mask", "logits_to_keep", "batch_size")
    and not name.startswith("compute_")
)


def precision(args) -> str:
    """Which precision generation and the training forwards run in, under these settings (one line)."""
    train = "bfloat16 autocast" if args.bf16 else "float16 autocast" if args.fp16 else "the model's dtype"
    rollout = "bfloat16 autocast (rollout_dtype)" if getattr(args, "rollout_dtype", None) else train
    return f"generation runs in {rollout}, the training forwards in {train}"


@dataclass
class GRPOConfig(trl.GRPOConfig):
    """TRL's ``GRPOConfig`` with rpb's fields (every other field is TRL's). A conflict among its fields is refused
    here, every one listed; the precision it runs in is said once."""

    router_aux_loss_coef: float | None = field(
        default=0.0,
        metadata={"help": "must stay 0.0: rpb adds no native load-balancing loss (use anchor.method=lbl)"},
    )
    replay: str = field(default="off", metadata={"help": "routing replay: 'off', 'R2', 'R3' or 'PR2' (docs/rl.md)"})
    pr2_lr_scale: float = field(
        default=1000.0,
        metadata={"help": "PR2: the predictor's learning rate as a multiple of learning_rate (the reference's alpha)"},
    )
    rollout_dtype: str | None = field(
        default=None,
        metadata={
            "help": "'bfloat16': generate under bfloat16 autocast while training runs in the model's dtype (needs "
            "bf16=False; an engine's precision gap)"
        },
    )
    routes_format: str = field(
        default="vllm",
        metadata={
            "help": "the shape of the 'routed_experts' a rollout_func returns per rollout: 'vllm' "
            "(CompletionOutput.routed_experts) or 'sglang' (meta_info['routed_experts'])"
        },
    )

    def __post_init__(self):
        super().__post_init__()
        problems = config_problems(self)
        if problems:
            raise ConfigError("rpb.integrations.trl.GRPOConfig", problems)
        _say_precision(self)


_SAID: set[str] = set()


def _say_precision(args) -> None:
    line = precision(args)
    if line not in _SAID:
        _SAID.add(line)
        logger.warning("rpb GRPO: %s", line)


class GRPOTrainer(HoldingTrainer, PredictiveReplay, RolloutRoutes, trl.GRPOTrainer):
    """TRL's ``GRPOTrainer`` with an rpb anchor (``anchor``: an installed ``AnchorHandle``; None installs the
    plain ``sft`` one, which adds nothing and lets ``rpb.monitor`` read the training forward) and routing replay
    (``args.replay``). ``model`` must be the model object the anchor was installed on. Everything else is
    TRL's, except what the module docstring lists.

    Its state: ``_generation`` (``rpb.integrations.trl.generation.GenerationState``), one generation batch from
    TRL's generation call to the batch dict it returns; ``_micro``, one training micro-batch from
    ``_prepare_inputs`` to the end of its ``training_step`` (its inputs, routes to replay, the anchor's scale, the
    open contexts, the training forward's log-probabilities)."""

    def __init__(
        self, model, reward_funcs, args: trl.GRPOConfig, train_dataset=None, *, anchor=None, monitor=None, **kwargs
    ):
        if isinstance(model, str):
            raise ConfigError("rpb.integrations.trl.GRPOTrainer", ["model: the loaded model object, not a name"])
        columns = tuple(getattr(train_dataset, "column_names", None) or ())
        problems = config_problems(args) + trainer_problems(
            args, model, anchor, columns, kwargs.get("rollout_func") is not None
        )
        problems += teacher_problems(args, anchor, model, kwargs.get("peft_config"))
        if problems:
            raise ConfigError("rpb.integrations.trl.GRPOTrainer", problems)
        hold_native_aux_off(args)
        _say_precision(args)
        self.anchor = anchor if anchor is not None else install_anchor(model, AnchorConfig(method="sft"))
        self.replay_mode = getattr(args, "replay", "off")
        self.rollout_dtype = getattr(args, "rollout_dtype", None)
        super().__init__(model=model, reward_funcs=reward_funcs, args=args, train_dataset=train_dataset, **kwargs)
        if self.model is not self.anchor.model:  # TRL wrapped it (peft_config): the routers that run are PEFT's
            self.anchor = self.anchor.reinstall(self.model)
        # routing-kd: the optimizer step's overlap with the reference's routing, a target's λ; the monitor
        self.hold_routing(monitor)
        self.replay = RouteReplay(self.model, adapter=self.anchor.facts.model_type)
        self._build_predictor()
        self._base_capture = None
        if self.anchor.method.teacher == "routing" and self.beta != 0.0:
            self._base_capture = BaseRoutingCapture()  # the reference forward's routing, read as TRL runs it
        elif self.anchor.method.teacher == "routing" and self.anchor.teacher is None:
            from rpb.teacher import OnlineBase

            self.anchor.teacher = OnlineBase("adapters-off", self.anchor.facts, self.model)
        # generate() forwards the causal LM itself, under any PEFT wrapper: its inputs say each step's shape
        base = self.model.get_base_model() if callable(getattr(self.model, "get_base_model", None)) else self.model
        self._generating = base
        if self.rollout_func is not None:
            self.rollout_func = self._reading_routes(self.rollout_func)
        self._generation: GenerationState | None = None
        self._micro: dict | None = None
        trained_unmoved = self.num_iterations == 1 and args.steps_per_generation <= args.gradient_accumulation_steps
        if self.replay_mode in ("R2", "PR2") and trained_unmoved:
            logger.warning(
                "rpb GRPO: replay=%r with num_iterations=1 and steps_per_generation (%d) <= "
                "gradient_accumulation_steps (%d): every micro-batch is trained before the policy moves, so the "
                "first forward's routing is the training forward's own; %s",
                self.replay_mode,
                args.steps_per_generation,
                args.gradient_accumulation_steps,
                "R2 equals 'off' plus one forced forward"
                if self.replay_mode == "R2"
                else "PR2's predictor never sees a later update and stays zero: PR2 equals R2",
            )

    def _is_policy(self, model) -> bool:
        """The trainer's own model, under any DDP / FSDP wrapper (the reference model is not)."""
        return model is self.model or self.accelerator.unwrap_model(model) is self.model

    @contextlib.contextmanager
    def _prior_rows(self, sample_B: torch.Tensor, span_BS: torch.Tensor, mask_BS: torch.Tensor):
        """The anchor's context over forwards of consecutive rows of these rollouts (TRL scores in chunks): each
        forward takes its own rows' (row, span), -1 on padding."""
        sample_BS = torch.where(mask_BS.bool(), sample_B.to(mask_BS.device)[:, None], -1)
        span_BS = span_BS.to(mask_BS.device)
        stack, taken = contextlib.ExitStack(), [0]

        def on_inputs(args, kwargs):
            ids = kwargs.get("input_ids", args[0] if args else None)
            rows = slice(taken[0], taken[0] + ids.shape[0])
            taken[0] = rows.stop
            stack.close()
            stack.enter_context(self.anchor.step(sample_BS[rows], span_BS[rows], mask_BS[rows]))

        with on_model_inputs(self.model, on_inputs), stack:
            yield

    def _trl_scores_old_logps(self) -> bool:
        """TRL's own condition for the old-log-prob forward in ``_generate_and_score_completions``."""
        generate_every = self.args.steps_per_generation * self.num_iterations
        return self.args.gradient_accumulation_steps % generate_every != 0 or (
            self.use_vllm and self.vllm_importance_sampling_correction
        )

    def _get_per_token_logps_and_entropies(self, model, input_ids, attention_mask, logits_to_keep, *a, **kw):
        state, policy = self._generation, self._is_policy(model)
        first = state is not None and state.scoring and policy and state.first_routes is None
        if first and self._trl_scores_old_logps():  # TRL's old-log-prob forward: the first training-side forward
            return self._first_forward(model, input_ids, attention_mask, logits_to_keep, *a, **kw)
        if state is not None and state.scoring and self._base_capture is not None and self._is_reference(model):
            with self._base_capture.reading(self.accelerator.unwrap_model(model), self.anchor.facts, logits_to_keep):
                out = super()._get_per_token_logps_and_entropies(
                    model, input_ids, attention_mask, logits_to_keep, *a, **kw
                )
            state.base_routing = self._base_capture.routing_BCLE()
            return out
        out = super()._get_per_token_logps_and_entropies(model, input_ids, attention_mask, logits_to_keep, *a, **kw)
        if self._micro is not None and policy and state is None:
            self._micro["train_logps"] = out[0].detach()
        return out

    def _is_reference(self, model) -> bool:
        """TRL's reference forward: the reference model, or (PEFT, no reference model) the policy with its adapters
        disabled."""
        return not self._is_policy(model) or adapters_disabled(self.accelerator.unwrap_model(model))

    def _first_forward(self, model, input_ids, attention_mask, logits_to_keep, *a, **kw):
        """The first training-side forward of a generation batch (no gradients): R3 replays the rollouts' routes,
        RPB biases it as the training forward will be, PR2 routes by its predictor (keeping the routers' inputs
        and logits at the completion positions); it records its own routing (R2's, and the flip rate's
        reference). The monitor and the anchor's statistics never see it: it is no training forward."""
        state = self._generation
        P = input_ids.shape[1] - logits_to_keep
        routes = self._batch_routes(P, logits_to_keep) if self.replay_mode == "R3" else None
        keep = logits_to_keep if self.pr2 is not None else 0
        biased = contextlib.nullcontext()
        if state.labels is not None:
            biased = self._prior_rows(*batch_labels(state.labels, P, logits_to_keep), attention_mask)
        with self.replay.forward(routes, predictor=self.pr2, keep_last=keep), biased, self.anchor.unobserved():
            out = super()._get_per_token_logps_and_entropies(model, input_ids, attention_mask, logits_to_keep, *a, **kw)
        state.first_routes = self.replay.native_BSLK
        if self.pr2 is not None:
            kept = (self.replay.chosen_BSLK, self.replay.kept_inputs_BCLH, self.replay.kept_BCLE)
            state.pr2 = dict(zip((PR2_ROUTES, PR2_INPUTS, PR2_LOGITS), kept, strict=True))
        return out

    def _generate_and_score_completions(self, inputs):
        if not self.model.training:  # evaluation: nothing recorded, replayed or biased
            return super()._generate_and_score_completions(inputs)
        state = self._generation = GenerationState(rows=inputs)
        try:
            output = super()._generate_and_score_completions(inputs)
            if self.replay_mode in ("R2", "PR2") and state.first_routes is None:
                # R2 replays the first forward's routing: run it where TRL would skip it (its log-probs then
                # serve as the old ones, equal to what TRL's would be), with every field TRL's forward takes
                fields = {k: output[k] for k in _FORWARD_FIELDS if k in output}
                with torch.no_grad():
                    logps, _, _ = self._first_forward(
                        self.model,
                        torch.cat([output["prompt_ids"], output["completion_ids"]], dim=1),
                        torch.cat([output["prompt_mask"], output["completion_mask"]], dim=1),
                        output["completion_ids"].shape[1],
                        batch_size=self.args.per_device_train_batch_size,
                        **fields,
                    )
                output["old_per_token_logps"] = logps
            state.scoring = False
            self._attach(output, state)
        finally:
            self._generation = None
        return output

    def _attach(self, output: dict, state: GenerationState) -> None:
        """The generation batch's routes, log-probabilities and labels into TRL's batch dict, which TRL shuffles
        and splits with the rollouts."""
        device = output["prompt_ids"].device
        P, C = output["prompt_ids"].shape[1], output["completion_ids"].shape[1]
        routes = self._batch_routes(P, C)
        if routes is not None:
            output["rpb_rollout_routes"] = routes.to(device)
            logps_BC = torch.full((routes.shape[0], C), float("nan"))
            for b, lp in enumerate(state.logps):
                logps_BC[b, : len(lp)] = lp
            output["rpb_rollout_logps"] = logps_BC.to(device)
        if state.first_routes is not None:
            output["rpb_first_routes"] = state.first_routes.to(device)
        if state.pr2 is not None:
            output.update({k: v.to(device) for k, v in state.pr2.items()})
            mib = sum(v.numel() * v.element_size() for v in state.pr2.values()) / 2**20
            said = f"PR2 carries its routes, the routers' inputs and logits at the completion positions: {mib:.1f} MiB"
            self._say_once("pr2-memory", f"rpb GRPO: {said} each generation batch")
        if state.labels is not None:
            sample_B, span_BS = batch_labels(state.labels, P, C)
            output["rpb_sample_index"] = sample_B.to(device)
            output["rpb_span_ids"] = span_BS.to(device)
        if state.base_routing is not None:
            output[BASE_ROUTING] = state.base_routing.to(device)
            mib = state.base_routing.numel() * 4 / 2**20
            shape = "x".join(map(str, state.base_routing.shape))
            said = f"each generation batch ([B, C, L, E] = {shape} float32, {mib:.1f} MiB)"
            self._say_once("base-routing", f"rpb GRPO: routing-kd carries the reference model's routing with {said}")

    def log(self, logs: dict, *args, **kwargs) -> None:
        if "loss" in logs:  # a training log, on every rank: the rollout figures over both ranks' tokens
            logs.update(self.routing_figures())
            logs.update(self.hold_logs())
        super().log(logs, *args, **kwargs)

    # ---- training: the anchor's context, replay, the anchor's term ---------------------------
    def _weights_BS(self, inputs) -> torch.Tensor:
        mask_BC = inputs["completion_mask"]
        if "tool_mask" in inputs:
            mask_BC = mask_BC * inputs["tool_mask"]
        w_BC = token_weights_BC(
            self.loss_type,
            mask_BC,
            accumulation=self.current_gradient_accumulation_steps,
            max_completion_length=self.max_completion_length,
            num_items_in_batch=inputs.get("num_items_in_batch"),
            num_processes=self.accelerator.num_processes,
            steps_per_generation=self.args.steps_per_generation,
        )
        return torch.cat([torch.zeros_like(inputs["prompt_mask"], dtype=w_BC.dtype), w_BC], dim=1)

    def prepared_rollouts(self) -> dict:
        """One micro-batch of rollouts from the trainer's own data, generated and scored now: ``rpb audit``
        trains on it as it is (a dict with ``completion_ids`` handed to ``training_step`` is never regenerated)."""
        was = self.model.training
        self.model.train()
        rollouts = self._generate_and_score_completions(next(iter(self.get_train_dataloader())))
        self.model.train(was)
        return split_tensor_dict(rollouts, self.args.steps_per_generation)[0]

    def _prepare_inputs(self, generation_batch):
        if isinstance(generation_batch, dict) and "completion_ids" in generation_batch:
            inputs = generation_batch  # rollouts already made (prepared_rollouts): trained on as they are
        else:
            inputs = super()._prepare_inputs(generation_batch)
        if self.model.training and self._micro is None:
            self._open_step(inputs)
        return inputs

    def _open_step(self, inputs) -> None:
        """The training forward's context, from the micro-batch TRL just handed out until its backward is done:
        the anchor's token weights and the routes to replay."""
        weights_BS = self._weights_BS(inputs)
        total = weights_BS.sum()
        mask_BS = torch.cat([inputs["prompt_mask"], inputs["completion_mask"]], dim=1)
        sample_BS = torch.zeros_like(mask_BS, dtype=torch.long)
        span_BS = torch.full_like(sample_BS, -1)  # no prior: no token takes a bias
        normalised_BS = (weights_BS / total if total > 0 else weights_BS).float()
        replayed = {"R3": "rpb_rollout_routes", "R2": "rpb_first_routes", "PR2": PR2_ROUTES}.get(self.replay_mode)
        routes = inputs.get(replayed) if replayed else None
        update = self.update_index()
        if "rpb_span_ids" in inputs:
            sample_BS = torch.where(mask_BS.bool(), inputs["rpb_sample_index"][:, None], -1)
            span_BS = inputs["rpb_span_ids"]
        base = None  # the base's routing first: its own forward (beta = 0) runs before any context opens
        if BASE_ROUTING in inputs:
            base = step_routing(inputs[BASE_ROUTING], inputs["prompt_ids"].shape[1])
        elif self.anchor.teacher is not None:
            batch = {"input_ids": torch.cat([inputs["prompt_ids"], inputs["completion_ids"]], dim=1)}
            base = self.anchor.base_routing(batch | {"attention_mask": mask_BS}, sample_BS)
        stack = contextlib.ExitStack()
        self._micro = {
            "inputs": inputs,
            "routes": routes,
            "scale": total,
            "update": update,
            "stack": stack,
            "train_logps": None,
        }
        stack.enter_context(self.anchor.step(sample_BS, span_BS, mask_BS, normalised_BS)).base = base
        keep = inputs["completion_ids"].shape[1] if self.pr2 is not None else 0  # _train_predictor picks the updates
        stack.enter_context(self.replay.forward(routes, keep_last=keep))

    def training_step(self, model, inputs, num_items_in_batch=None):
        try:
            return super().training_step(model, inputs, num_items_in_batch)
        finally:
            if self._micro is not None:
                self._micro["stack"].close()
            self._micro = None

    def _compute_loss(self, model, inputs):
        loss = super()._compute_loss(model, inputs)
        if not self.model.training or self._micro is None:
            return loss
        self._log_mismatch(self._micro)
        self._train_predictor(self._micro)
        if self.anchor.method.loss is None:
            return loss
        term = self.anchor.loss()
        if self.anchor.method.loss.from_forward:
            scale = self._micro["scale"]
        else:  # a term on the router weights: once per optimizer step
            scale = 1.0 / self.current_gradient_accumulation_steps
        scaled = term * torch.as_tensor(scale, dtype=term.dtype, device=term.device)
        self._metrics["train"][f"anchor/{self.anchor.method.name}"].append(float(term.detach()))
        return loss + scaled
