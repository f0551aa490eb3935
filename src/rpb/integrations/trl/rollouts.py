"""The rollout side of rpb's ``GRPOTrainer``: each rollout's routes and log-probabilities, recorded as ``generate``
makes them or read from a ``rollout_func``'s engine output, and RPB's token labels, on every generation path;
and the mismatch figures that compare them with the training forward (docs/rl.md).

``RolloutRoutes`` is a mixin of ``rpb.integrations.trl.grpo.GRPOTrainer`` (before TRL's class in its bases): it
reads the trainer's ``replay`` (``rpb.replay.RouteReplay``), ``anchor``, ``replay_mode``, ``rollout_dtype`` and
``_generating`` (the causal LM ``generate`` forwards), and fills the generation batch's ``GenerationState``
(``_generation``, None outside training's generation: evaluation records nothing and routes freely).

The generation paths, and what each gives (RPB's labels come from the tokens on every one):

* ``generate``, with a KV cache or without, chunked prefill, left padding, TRL's tool loop: routes recorded and
  placed by position (``rpb.replay.record``, ``rpb.integrations.trl.generation``);
* a ``rollout_func`` returning ``routed_experts``: the engine's routes, checked against the model;
* a ``rollout_func`` without them, ``use_vllm``, ``use_transformers_continuous_batching``: no routes (R3 refused,
  the rollout figures off, said once).

Shape legend: B = rollouts, P / C = padded prompt / completion lengths, S = P + C, L = MoE layers, K = top-k.
"""

from __future__ import annotations

import contextlib
import logging
import math

import torch
from trl.trainer.utils import pad

from rpb.errors import ConfigError
from rpb.integrations.trl.generation import GenerationState
from rpb.integrations.trl.rl_prior import rollout_labels
from rpb.replay import GenerationRecorder, batch_routes, routes_from_sglang, routes_from_vllm
from rpb.replay.mismatch import agreed_for_completion, completion_positions, differs_BSL, flips_L, logp_gap
from rpb.replay.routes import routed_positions

logger = logging.getLogger(__name__)

#: GRPOConfig.routes_format -> the reader of one rollout's engine routes
ROUTE_READERS = {"vllm": routes_from_vllm, "sglang": routes_from_sglang}
#: the mismatch figures, each a sum over a logging window's micro-batches and ranks divided by its tokens (the
#: flip rates and the stale mismatch by tokens x layers); ``routing/rollout_logp_missing`` is the window's count;
#: ``routing/stale_mismatch/update_<i>`` beside them for each update index a batch reaches
FIGURES = (
    "routing/rollout_flip_rate",
    "routing/rollout_override_rate",
    "routing/stale_mismatch",
    "routing/rollout_logp_gap",
    "routing/rollout_logp_gap_agreed",
    "routing/rollout_logp_gap_disagreed",
    "routing/rollout_logp_missing",
    # PR2 only: the same stale count against the routes R2 would have replayed on this trajectory (the batch's
    # first-forward routes), and at update 0 the share of expert sets the predictor changed
    "routing/stale_mismatch_r2",
    "pr2/changed_share",
)


def update_index(step: int, generate_every: int, accumulation: int) -> int:
    """How many optimizer updates the policy has taken since micro-batch ``step``'s generation batch was made
    (TRL generates at every ``generate_every``-th micro-batch and steps the optimizer after every
    ``accumulation``-th): 0 while the policy is still the one that generated it, i after i updates. The Trainer
    also steps at an epoch's end: an epoch whose micro-batches are not a multiple of ``accumulation`` would shift
    the count by one there (TRL's generation batches, multiples of ``steps_per_generation``, keep it aligned when
    ``steps_per_generation`` is a multiple of ``accumulation``, its default)."""
    start = step - step % generate_every
    return step // accumulation - start // accumulation


def logp_value(value) -> float:
    """A rollout's log-probability as a float: None (vLLM's NaN reported so) is NaN, a missing value."""
    return float("nan") if value is None else float(value)


class RolloutRoutes:
    """Routes, log-probabilities and labels of each rollout, and the mismatch figures (see the module docstring)."""

    _generation: GenerationState | None = None
    _said: frozenset = frozenset()
    #: figure -> [sum, weight] over the logging window on this rank
    _window: dict | None = None

    def _say_once(self, key: str, message: str) -> None:
        if key not in self._said:
            self._said = self._said | {key}
            logger.warning(message)

    def _precision(self):
        """Generation under bfloat16 autocast (``rollout_dtype``), an engine's precision gap on the CPU."""
        if self.rollout_dtype == "bfloat16":
            return torch.autocast(self.accelerator.device.type, dtype=torch.bfloat16)
        return contextlib.nullcontext()

    # ---- generation: each generate call -------------------------------------------------------
    def _generate_single_turn(self, prompt_ids, images, multimodal_fields, num_generations, has_tool_images=False):
        args = (prompt_ids, images, multimodal_fields, num_generations, has_tool_images)
        state = self._generation
        if self.use_vllm or self.use_transformers_continuous_batching:
            return super()._generate_single_turn(*args)
        if state is None or state.from_engine:  # evaluation; or an engine's rollouts, continued by TRL's tools
            if state is not None and state.problem is None:
                state.problem = "TRL's tool loop continued a rollout_func's rollouts, past the engine's routes"
            with self._precision():
                return super()._generate_single_turn(*args)
        with GenerationRecorder(self._generating, self.replay.layers, self.temperature) as rec, self._precision():
            completion_ids, logprobs = super()._generate_single_turn(*args)
        if rec.problem is not None:
            kwargs = f" (generation_kwargs={self.generation_kwargs!r})" if self.generation_kwargs else ""
            state.problem = state.problem or rec.problem + kwargs
            return completion_ids, logprobs
        routes_BSLK = rec.routes_BSLK
        # P exactly as TRL padded the prompts for generate (its own function, its pad_to_multiple_of)
        P = pad([torch.zeros(len(p), dtype=torch.int8) for p in prompt_ids], 0, "left", self.pad_to_multiple_of)
        P = P.shape[1]
        generated = routes_BSLK.shape[1] + 1 - P
        # only a full-length row's last token was never forwarded; the others' values are read already
        last_B1 = torch.tensor([[c[-1] if len(c) == generated else 0] for c in completion_ids], dtype=torch.long)
        state.add_turn(prompt_ids, completion_ids, routes_BSLK, rec.logps(last_B1, prompt_len=P), P)
        return completion_ids, logprobs

    def _reading_routes(self, rollout_func):
        """``rollout_func`` (an engine's rollouts) with its ``routed_experts`` read into rpb's routes: one entry per
        rollout in ``routes_format``'s shape, checked against the model; its ``logprobs`` are the rollout's (None
        or NaN: missing)."""

        def read(prompts, trainer):
            out = rollout_func(prompts, trainer)
            state = self._generation
            if state is not None:
                state.from_engine = True
            if state is None or "routed_experts" not in out:
                return out
            reader, spec = ROUTE_READERS[self.args.routes_format], self.replay.specs[0]
            layers = [m.layer_index for m in self.replay.layers]
            total = self._generating.config.get_text_config().num_hidden_layers
            rollouts = zip(out["routed_experts"], out["prompt_ids"], out["completion_ids"], strict=True)
            routes = []
            for i, (raw, p, c) in enumerate(rollouts):
                fit = {"moe_layers": layers, "top_k": spec.top_k, "num_experts": spec.num_experts, "num_layers": total}
                routes.append(reader(raw, num_tokens=len(p) + len(c), name=f"rollout {i}", **fit))
            state.routes = routes
            state.logps = [torch.tensor([logp_value(v) for v in lp], dtype=torch.float32) for lp in out["logprobs"]]
            return out

        return read

    # ---- generation: the whole batch, every path ------------------------------------------------
    def _generate(self, prompts):
        out = super()._generate(prompts)
        state = self._generation
        if state is None:
            return out
        prompt_ids, completion_ids, tool_mask = out[0], out[1], out[2]
        if state.routes is None:
            state.close(prompt_ids, completion_ids)
        self._settle_routes(state)
        if self.anchor.prior is not None:  # from the tokens, whatever path made them
            state.labels = rollout_labels(state.rows, prompt_ids, completion_ids, tool_mask)
        return out

    def _settle_routes(self, state: GenerationState) -> None:
        """R3 without routes is refused by name at the first batch; under R2 or off the run goes on without the
        rollout figures, said once with the reason."""
        if state.problem is not None:
            state.routes = state.logps = None
            reason = f"the rollouts' routes cannot be placed: {state.problem}"
        elif state.routes is None:
            reason = (
                "this generation path records no routes ("
                + ", ".join(self._unrecorded_settings())
                + "): hand an engine's in with a rollout_func returning 'routed_experts' (docs/rl.md)"
            )
        else:
            return
        if self.replay_mode == "R3":
            raise ConfigError("rpb.integrations.trl.GRPOTrainer", [f"replay='R3': {reason}"])
        self._say_once("no-routes", f"rpb GRPO: routing/rollout_* figures are off: {reason}")

    def _unrecorded_settings(self) -> list[str]:
        settings = [
            name
            for name, on in (
                ("use_vllm", self.use_vllm),
                ("use_transformers_continuous_batching", self.use_transformers_continuous_batching),
                ("a rollout_func without 'routed_experts'", self.rollout_func is not None),
            )
            if on
        ]
        return settings or ["no generate call was recorded"]

    def _batch_routes(self, P: int, C: int) -> torch.Tensor | None:
        """The generation batch's rollout routes in TRL's padded layout (None when it has none)."""
        state = self._generation
        if state is None or state.routes is None:
            return None
        lengths = [r.shape[0] + 1 for r in state.routes]
        completion = [len(lp) for lp in state.logps]
        prompt_mask_BP = torch.zeros((len(lengths), P), dtype=torch.long)
        completion_mask_BC = torch.zeros((len(lengths), C), dtype=torch.long)
        for b, (n, c) in enumerate(zip(lengths, completion, strict=True)):
            prompt_mask_BP[b, P - (n - c) :] = 1
            completion_mask_BC[b, :c] = 1
        return batch_routes(state.routes, prompt_mask_BP, completion_mask_BC)

    # ---- the mismatch figures ------------------------------------------------------------
    def _add(self, name: str, total: float, weight: float) -> None:
        self._window = self._window or {}
        entry = self._window.setdefault(name, [0.0, 0.0])
        entry[0] += total
        entry[1] += weight

    def update_index(self) -> int:
        """The current micro-batch's update index in its generation batch (``update_index``)."""
        generate_every = self.args.steps_per_generation * self.num_iterations
        return update_index(self._step, generate_every, self.args.gradient_accumulation_steps)

    def _figure_names(self) -> tuple[str, ...]:
        """``FIGURES`` and a stale figure per update index >= 1 a generation batch can reach (the same on every
        rank: the schedule is the config's)."""
        generate_every = self.args.steps_per_generation * self.num_iterations
        accumulation = self.args.gradient_accumulation_steps
        reached = {update_index(s, generate_every, accumulation) for s in range(generate_every * accumulation)}
        later = [i for i in sorted(reached) if i >= 1]
        per_update = tuple(f"routing/stale_mismatch/update_{i}" for i in later)
        if self.replay_mode == "PR2":
            per_update += tuple(f"routing/stale_mismatch_r2/update_{i}" for i in later)
        return FIGURES + per_update

    def routing_figures(self) -> dict[str, float]:
        """The logging window's mismatch figures, summed over ranks first (every rank calls it at every training
        log, as TRL's ``log`` runs on every rank); the window restarts. A figure with no token is absent."""
        window, self._window = self._window or {}, {}
        names = self._figure_names()
        flat = torch.tensor([v for name in names for v in window.get(name, (0.0, 0.0))], dtype=torch.float64)
        if self.accelerator.num_processes > 1:
            flat = self.accelerator.reduce(flat.to(self.accelerator.device), reduction="sum").cpu()
        out = {}
        for i, name in enumerate(names):
            total, weight = float(flat[2 * i]), float(flat[2 * i + 1])
            if weight > 0:
                out[name] = total if name.endswith("_missing") else total / weight
        return out

    def _log_mismatch(self, micro: dict) -> None:
        inputs, replayed = micro["inputs"], micro["routes"]
        native = self.replay.native_BSLK.to(inputs["completion_mask"].device)
        P = inputs["prompt_ids"].shape[1]
        mask_BC = inputs["completion_mask"]
        if "tool_mask" in inputs:  # a tool's result is no rollout's choice: it counts in no figure
            mask_BC = mask_BC * inputs["tool_mask"]
        completion_BS = completion_positions(P, mask_BC.bool())
        first = inputs.get("rpb_first_routes")
        if micro["update"] == 0 and first is None:
            # no scoring forward ran: this one is the batch's first (the buffered dict keeps it)
            first = inputs["rpb_first_routes"] = native
        self._log_stale(micro, native, completion_BS)
        if "rpb_rollout_routes" not in inputs:
            return
        rollout = inputs["rpb_rollout_routes"]
        count_BS = completion_BS & routed_positions(rollout)
        tokens, L = float(count_BS.sum()), rollout.shape[2]
        if micro["update"] == 0:
            # the router's own choice in the batch's first forward against the rollout's. Under R3 that forward runs
            # on the rollout's routes, so its own choice is read on hidden states the rollout's routing made: the
            # share of layer choices R3 overrides, another figure than the free forward's flip rate (docs/rl.md)
            name = "routing/rollout_override_rate" if self.replay_mode == "R3" else "routing/rollout_flip_rate"
            self._add(name, float(flips_L(rollout, first, count_BS).sum()), tokens * L)
        used = native if replayed is None else torch.where(replayed >= 0, replayed, native)
        agreed_BC = agreed_for_completion(differs_BSL(rollout, used) & routed_positions(rollout)[..., None], P)
        # the first update only: later ones add the policy's own change since the rollout (the importance ratio)
        if micro["update"] == 0 and micro.get("train_logps") is not None and "rpb_rollout_logps" in inputs:
            rollout_BC = inputs["rpb_rollout_logps"]
            seen_BC = ~torch.isnan(rollout_BC)
            self._add("routing/rollout_logp_missing", float((mask_BC.bool() & ~seen_BC).sum()), 1.0)
            gap = logp_gap(rollout_BC.nan_to_num(0.0), micro["train_logps"], agreed_BC, mask_BC * seen_BC)
            for name in ("all", "agreed", "disagreed"):
                n = gap[f"{name}_tokens"]
                key = "routing/rollout_logp_gap" if name == "all" else f"routing/rollout_logp_gap_{name}"
                if n and not math.isnan(gap[name]):
                    self._add(key, gap[name] * n, n)

    def _log_stale(self, micro: dict, native_BSLK: torch.Tensor, completion_BS: torch.Tensor) -> None:
        """``routing/stale_mismatch`` (and its update's): in an update after a batch's first, the share of completion
        tokens x MoE layers whose live top-k set differs from the routes the mode replays; under ``off``, from the
        first training-side forward's own choice (staleness, not the rollout's precision gap)."""
        i = micro["update"]
        against = micro["routes"] if self.replay_mode != "off" else micro["inputs"].get("rpb_first_routes")
        if self.replay_mode == "PR2":
            self._log_pr2_against_r2(micro, native_BSLK, completion_BS)
        if i < 1 or against is None:
            return
        against = against.to(native_BSLK.device)
        count_BS = completion_BS & routed_positions(against)
        flips, weight = float(flips_L(native_BSLK, against, count_BS).sum()), float(count_BS.sum()) * against.shape[2]
        self._add("routing/stale_mismatch", flips, weight)
        self._add(f"routing/stale_mismatch/update_{i}", flips, weight)

    def _log_pr2_against_r2(self, micro: dict, native_BSLK: torch.Tensor, completion_BS: torch.Tensor) -> None:
        """PR2 judged against R2 on its own trajectory: in later updates the live choice against the batch's
        first-forward routes (what R2 would replay: ``routing/stale_mismatch_r2``); at update 0 the share of the
        first forward's expert sets the predictor changed (``pr2/changed_share``)."""
        inputs, i = micro["inputs"], micro["update"]
        first = inputs.get("rpb_first_routes")
        if first is None:
            return
        first = first.to(native_BSLK.device)
        count_BS = completion_BS & routed_positions(first)
        weight = float(count_BS.sum()) * first.shape[2]
        if i == 0 and micro["routes"] is not None:
            changed = float(flips_L(micro["routes"].to(first.device), first, count_BS).sum())
            self._add("pr2/changed_share", changed, weight)
        elif i >= 1:
            flips = float(flips_L(native_BSLK, first, count_BS).sum())
            self._add("routing/stale_mismatch_r2", flips, weight)
            self._add(f"routing/stale_mismatch_r2/update_{i}", flips, weight)
