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
  ``router-l2`` is added once per optimizer step; ``router-freeze`` has no term. The prior-based selections
  (``rpb`` and its controls) are refused here: their RL rule is not built yet (docs/rl.md says what is).
* **Routing replay** (``GRPOConfig.replay``; ``rpb.replay``): ``R3`` replays each rollout's routes, recorded as
  ``generate`` made them; ``R2`` replays the first training-side forward's own routing (the old-log-prob forward,
  forced on) in the later updates of its batch; ``off`` replays nothing. The routes travel in the batch dict
  (``rpb_rollout_routes`` / ``rpb_first_routes``), through TRL's shuffling and splitting. The reference model
  (``beta`` > 0) routes freely: it stands for the base as deployed.
* **Mismatch figures** each logging step: ``routing/rollout_flip_rate`` (rollout against the first training-side
  forward's own choice), ``routing/stale_flip_rate`` (that first forward against the current one, later updates
  only), and, in a batch's first update, the log-probability gap over completion tokens whose routing agreed in
  every layer and over the rest (``routing/rollout_logp_gap_agreed`` / ``_disagreed``).
* ``rollout_dtype="bfloat16"`` generates under bfloat16 autocast, an engine's precision gap on the CPU.
"""

from __future__ import annotations

import contextlib
import logging
from dataclasses import dataclass, field

import torch
import trl
from trl.trainer.utils import split_tensor_dict

from rpb.anchors import AnchorConfig, AnchorHandle, install_anchor
from rpb.config import ConfigError
from rpb.integrations.trl.scaling import SCALING, token_weights_BC
from rpb.replay import REPLAY_MODES, GenerationRecorder, RouteReplay, batch_routes, rollout_routes
from rpb.replay.mismatch import agreed_for_completion, completion_positions, differs_BSL, flip_rate_L, logp_gap
from rpb.replay.routes import routed_positions

logger = logging.getLogger(__name__)

_TOLD = False  # the aux-loss note is logged once per process


@dataclass
class GRPOConfig(trl.GRPOConfig):
    """TRL's ``GRPOConfig`` with rpb's fields (every other field is TRL's)."""

    router_aux_loss_coef: float | None = field(
        default=0.0,
        metadata={"help": "must stay 0.0: rpb adds no native load-balancing loss (use anchor.method=lbl)"},
    )
    replay: str = field(default="off", metadata={"help": "routing replay: 'off', 'R2' or 'R3' (docs/rl.md)"})
    rollout_dtype: str | None = field(
        default=None, metadata={"help": "'bfloat16': generate under bfloat16 autocast (an engine's precision gap)"}
    )


def _problems(args, anchor: AnchorHandle | None) -> list[str]:
    out = []
    if args.router_aux_loss_coef not in (None, 0.0):
        out.append(
            f"router_aux_loss_coef={args.router_aux_loss_coef}: rpb runs add no native load-balancing loss; for a "
            "load-balancing anchor use anchor.method=lbl (one term, rpb's own)"
        )
    if args.loss_type not in SCALING:
        out.append(
            f"loss_type={args.loss_type!r}: the anchors do not know how this TRL loss aggregates its tokens, so "
            f"they cannot be scaled to it (known: {', '.join(sorted(SCALING))})"
        )
    replay = getattr(args, "replay", "off")
    if replay not in REPLAY_MODES:
        out.append(f"replay={replay!r}: one of {', '.join(REPLAY_MODES)}")
    if anchor is not None and anchor.method.needs_prior:
        why = (
            "R3 replays the rollout's routes, which are bias-free, so the bias would choose nothing"
            if replay == "R3"
            else "the rule for a prior in RL (prompt and completion tokens) is not built yet"
        )
        out.append(f"anchor.method={anchor.method.name} with GRPO: {why} (docs/rl.md)")
    if replay != "off" and getattr(args, "use_transformers_continuous_batching", False):
        out.append(
            "use_transformers_continuous_batching with replay: the paged generate_batch path mixes requests in "
            "one forward and returns no per-token routes to record; use the regular generate path"
        )
    if replay == "R3" and getattr(args, "use_vllm", False):
        out.append(
            "use_vllm with replay='R3': TRL's vLLM client returns no routes, and rpb does not patch it (docs/rl.md)"
        )
    if getattr(args, "rollout_dtype", None) not in (None, "bfloat16"):
        out.append(f"rollout_dtype={args.rollout_dtype!r}: None or 'bfloat16'")
    return out


class GRPOTrainer(trl.GRPOTrainer):
    """TRL's ``GRPOTrainer`` with an rpb anchor (``anchor``: an installed ``AnchorHandle``; None installs the
    plain ``sft`` one, which adds nothing and lets ``rpb.monitor`` read the training forward) and routing replay
    (``args.replay``). ``model`` must be the model object the anchor was installed on. Everything else is
    TRL's, except what the module docstring lists."""

    def __init__(self, model, reward_funcs, args: trl.GRPOConfig, train_dataset=None, *, anchor=None, **kwargs):
        if isinstance(model, str):
            raise ConfigError("rpb.integrations.trl.GRPOTrainer", ["model: the loaded model object, not a name"])
        problems = _problems(args, anchor)
        if problems:
            raise ConfigError("rpb.integrations.trl.GRPOTrainer", problems)
        global _TOLD
        if not _TOLD:
            was = "unset: TRL would use the model config's" if args.router_aux_loss_coef is None else "0.0"
            logger.warning(
                "rpb: router_aux_loss_coef=0.0 (%s); no native load-balancing loss in any mode, "
                "rpb's own is anchor.method=lbl",
                was,
            )
            _TOLD = True
        args.router_aux_loss_coef = 0.0
        self.anchor = anchor if anchor is not None else install_anchor(model, AnchorConfig(method="sft"))
        self._own_anchor = anchor is None
        self.replay_mode = getattr(args, "replay", "off")
        self.rollout_dtype = getattr(args, "rollout_dtype", None)
        super().__init__(model=model, reward_funcs=reward_funcs, args=args, train_dataset=train_dataset, **kwargs)
        if self.model is not self.anchor.model:  # TRL wrapped it (peft_config): the routers that run are PEFT's
            self.anchor = self.anchor.reinstall(self.model)
        self.replay = RouteReplay(self.model, adapter=self.anchor.facts.model_type)
        self._pending: dict | None = None  # one generation's routes and log-probabilities
        self._scoring = False  # inside _generate_and_score_completions
        self._first_routes: torch.Tensor | None = None
        self._train_logps: torch.Tensor | None = None
        self._step_stack: contextlib.ExitStack | None = None
        self._micro: dict | None = None

    # ---- generation: record each rollout's routes ---------------------------------------
    def _generate_single_turn(self, prompt_ids, images, multimodal_fields, num_generations, has_tool_images=False):
        args = (prompt_ids, images, multimodal_fields, num_generations, has_tool_images)
        if self.use_vllm or self.use_transformers_continuous_batching:
            return super()._generate_single_turn(*args)
        precision = (
            torch.autocast(self.accelerator.device.type, dtype=torch.bfloat16)
            if self.rollout_dtype == "bfloat16"
            else contextlib.nullcontext()
        )
        with GenerationRecorder(self.model, self.replay.layers, self.temperature) as rec, precision:
            completion_ids, logprobs = super()._generate_single_turn(*args)
        routes_BSLK = rec.routes_BSLK
        B, P = len(prompt_ids), rec.prompt_len
        generated = routes_BSLK.shape[1] + 1 - P
        keep_BS = torch.zeros((B, P + generated), dtype=torch.bool)
        last_B1 = torch.zeros((B, 1), dtype=torch.long)
        for b, (p, c) in enumerate(zip(prompt_ids, completion_ids, strict=True)):
            keep_BS[b, P - len(p) : P + len(c)] = True
            last_B1[b, 0] = c[-1] if len(c) == generated else 0  # only a full-length row's last token is unread
        logps_BC = rec.logps(last_B1)
        self._pending = {
            "routes": rollout_routes(routes_BSLK, keep_BS),
            "logps": [logps_BC[b, : len(c)] for b, c in enumerate(completion_ids)],
        }
        return completion_ids, logprobs

    def _trl_scores_old_logps(self) -> bool:
        """TRL's own condition for the old-log-prob forward in ``_generate_and_score_completions``."""
        generate_every = self.args.steps_per_generation * self.num_iterations
        return self.args.gradient_accumulation_steps % generate_every != 0 or (
            self.use_vllm and self.vllm_importance_sampling_correction
        )

    def _get_per_token_logps_and_entropies(self, model, input_ids, attention_mask, logits_to_keep, *a, **kw):
        if self._scoring and model is self.model and self._first_routes is None and self._trl_scores_old_logps():
            # TRL's old-log-prob forward: the first training-side forward of the batch
            return self._first_forward(model, input_ids, attention_mask, logits_to_keep, *a, **kw)
        out = super()._get_per_token_logps_and_entropies(model, input_ids, attention_mask, logits_to_keep, *a, **kw)
        if not self._scoring and model is self.model:
            self._train_logps = out[0].detach()
        return out

    def _first_forward(self, model, input_ids, attention_mask, logits_to_keep, *a, **kw):
        routes = self._pending_batch_routes(input_ids.shape[1] - logits_to_keep, logits_to_keep)
        with self.replay.forward(routes if self.replay_mode == "R3" else None):
            out = super()._get_per_token_logps_and_entropies(model, input_ids, attention_mask, logits_to_keep, *a, **kw)
        self._first_routes = self.replay.native_BSLK.cpu()
        return out

    def _pending_batch_routes(self, P: int, C: int) -> torch.Tensor | None:
        if self._pending is None:
            return None
        lengths = [r.shape[0] + 1 for r in self._pending["routes"]]
        completion = [len(lp) for lp in self._pending["logps"]]
        prompt_mask_BP = torch.zeros((len(lengths), P), dtype=torch.long)
        completion_mask_BC = torch.zeros((len(lengths), C), dtype=torch.long)
        for b, (n, c) in enumerate(zip(lengths, completion, strict=True)):
            prompt_mask_BP[b, P - (n - c) :] = 1
            completion_mask_BC[b, :c] = 1
        return batch_routes(self._pending["routes"], prompt_mask_BP, completion_mask_BC)

    def _generate_and_score_completions(self, inputs):
        self._pending, self._first_routes, self._scoring = None, None, True
        try:
            output = super()._generate_and_score_completions(inputs)
            if self.replay_mode == "R2" and self._first_routes is None and self.model.training:
                # R2 replays the first forward's routing: run it where TRL would skip it (its log-probs then
                # serve as the old ones, equal to what TRL's would be)
                input_ids = torch.cat([output["prompt_ids"], output["completion_ids"]], dim=1)
                mask = torch.cat([output["prompt_mask"], output["completion_mask"]], dim=1)
                with torch.no_grad():
                    logps, _, _ = self._first_forward(
                        self.model,
                        input_ids,
                        mask,
                        output["completion_ids"].shape[1],
                        batch_size=self.args.per_device_train_batch_size,
                    )
                output["old_per_token_logps"] = logps
        finally:
            self._scoring = False
        P, C = output["prompt_ids"].shape[1], output["completion_ids"].shape[1]
        routes = self._pending_batch_routes(P, C)
        if routes is not None:
            output["rpb_rollout_routes"] = routes.to(output["prompt_ids"].device)
            logps_BC = torch.zeros((routes.shape[0], C), dtype=torch.float32)
            for b, lp in enumerate(self._pending["logps"]):
                logps_BC[b, : len(lp)] = lp
            output["rpb_rollout_logps"] = logps_BC.to(output["prompt_ids"].device)
        if self._first_routes is not None:
            output["rpb_first_routes"] = self._first_routes.to(output["prompt_ids"].device)
        self._pending = self._first_routes = None
        return output

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
        if self.model.training and self._step_stack is None:
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
        routes = {"R3": inputs.get("rpb_rollout_routes"), "R2": inputs.get("rpb_first_routes")}.get(self.replay_mode)
        generate_every = self.args.steps_per_generation * self.num_iterations
        self._micro = {
            "inputs": inputs,
            "routes": routes,
            "scale": total,
            "first_update": (self._step % generate_every) // self.args.steps_per_generation == 0,
        }
        stack = contextlib.ExitStack()
        stack.enter_context(self.anchor.step(sample_BS, span_BS, mask_BS, normalised_BS))
        stack.enter_context(self.replay.forward(routes))
        self._step_stack = stack

    def training_step(self, model, inputs, num_items_in_batch=None):
        try:
            return super().training_step(model, inputs, num_items_in_batch)
        finally:
            if self._step_stack is not None:
                self._step_stack.close()
            self._step_stack = self._micro = None

    def _compute_loss(self, model, inputs):
        loss = super()._compute_loss(model, inputs)
        if not self.model.training or self._micro is None:
            return loss
        self._log_mismatch(self._micro)
        if self.anchor.method.loss is None:
            return loss
        term = self.anchor.loss()
        if self.anchor.method.loss.from_forward:
            scale = self._micro["scale"]
        else:  # a term on the router weights: once per optimizer step
            scale = 1.0 / self.current_gradient_accumulation_steps
        return loss + term * torch.as_tensor(scale, dtype=term.dtype, device=term.device)

    # ---- the mismatch figures ------------------------------------------------------------
    def _log_mismatch(self, micro: dict) -> None:
        inputs, replayed = micro["inputs"], micro["routes"]
        if "rpb_rollout_routes" not in inputs:
            return
        rollout = inputs["rpb_rollout_routes"]
        native = self.replay.native_BSLK.to(rollout.device)
        P = inputs["prompt_ids"].shape[1]
        count_BS = completion_positions(P, inputs["completion_mask"].bool()) & routed_positions(rollout)
        metrics = self._metrics["train"]
        first = inputs.get("rpb_first_routes")
        if micro["first_update"]:
            if first is None:  # no scoring forward ran: this one is the batch's first (the buffered dict keeps it)
                first = inputs["rpb_first_routes"] = native
            metrics["routing/rollout_flip_rate"].append(float(flip_rate_L(rollout, first, count_BS).nanmean()))
        elif first is not None:
            metrics["routing/stale_flip_rate"].append(float(flip_rate_L(first, native, count_BS).nanmean()))
        used = native if replayed is None else torch.where(replayed >= 0, replayed, native)
        agreed_BC = agreed_for_completion(differs_BSL(rollout, used) & routed_positions(rollout)[..., None], P)
        # the first update only: later ones add the policy's own change since the rollout (the importance ratio)
        if micro["first_update"] and self._train_logps is not None and "rpb_rollout_logps" in inputs:
            gap = logp_gap(inputs["rpb_rollout_logps"], self._train_logps, agreed_BC, inputs["completion_mask"])
            for name in ("agreed", "disagreed"):
                if gap[f"{name}_tokens"]:
                    metrics[f"routing/rollout_logp_gap_{name}"].append(gap[name])
