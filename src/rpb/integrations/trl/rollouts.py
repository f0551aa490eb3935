"""The rollout side of rpb's ``GRPOTrainer``: each rollout's routes and log-probabilities, recorded as
``generate`` makes them or read from a ``rollout_func``'s engine output, laid out for the batch; and the
mismatch figures that compare them with the training forward (docs/rl.md).

``RolloutRoutes`` is a mixin of ``rpb.integrations.trl.grpo.GRPOTrainer`` (before TRL's class in its bases): it
reads the trainer's ``replay`` (``rpb.replay.RouteReplay``), ``anchor``, ``replay_mode``, ``rollout_dtype``,
``_generating`` (the causal LM ``generate`` forwards) and ``_rows`` (the generation batch's dataset rows), and
leaves one generation's ``_pending`` routes, log-probabilities and (with a prior) token labels.

Shape legend: B = rollouts, P / C = padded prompt / completion lengths, S = P + C, L = MoE layers, K = top-k.
"""

from __future__ import annotations

import contextlib

import torch

from rpb.config import ConfigError
from rpb.integrations.trl.rl_prior import rollout_labels
from rpb.replay import GenerationRecorder, batch_routes, rollout_routes, routes_from_sglang, routes_from_vllm
from rpb.replay.mismatch import agreed_for_completion, completion_positions, differs_BSL, flip_rate_L, logp_gap
from rpb.replay.routes import routed_positions

#: GRPOConfig.routes_format -> the reader of one rollout's engine routes
ROUTE_READERS = {"vllm": routes_from_vllm, "sglang": routes_from_sglang}


class RolloutRoutes:
    """Routes and log-probabilities of each rollout, and the mismatch figures (see the module docstring)."""

    # ---- generation: each rollout's routes and log-probabilities ------------------------------
    def _generate_single_turn(self, prompt_ids, images, multimodal_fields, num_generations, has_tool_images=False):
        args = (prompt_ids, images, multimodal_fields, num_generations, has_tool_images)
        if self.use_vllm or self.use_transformers_continuous_batching:
            return super()._generate_single_turn(*args)
        precision = (
            torch.autocast(self.accelerator.device.type, dtype=torch.bfloat16)
            if self.rollout_dtype == "bfloat16"
            else contextlib.nullcontext()
        )
        with GenerationRecorder(self._generating, self.replay.layers, self.temperature) as rec, precision:
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
        if self.anchor.prior is not None:
            self._pending["labels"] = rollout_labels(self._rows, prompt_ids, completion_ids)
        return completion_ids, logprobs

    def _reading_routes(self, rollout_func):
        """``rollout_func`` (an engine's rollouts) with its ``routed_experts`` read into rpb's routes: one entry per
        rollout in ``routes_format``'s shape, checked against the model; its ``logprobs`` are the rollout's."""

        def read(prompts, trainer):
            out = rollout_func(prompts, trainer)
            self._pending = None
            if "routed_experts" not in out:
                if self.replay_mode == "R3":
                    raise ConfigError(
                        "rpb.integrations.trl.GRPOTrainer",
                        ["replay='R3': the rollout_func returned no 'routed_experts', so there is nothing to replay"],
                    )
                return out
            reader, spec = ROUTE_READERS[self.args.routes_format], self.replay.specs[0]
            layers = [m.layer_index for m in self.replay.layers]
            total = self._generating.config.get_text_config().num_hidden_layers
            rollouts = zip(out["routed_experts"], out["prompt_ids"], out["completion_ids"], strict=True)
            routes = []
            for i, (raw, p, c) in enumerate(rollouts):
                fit = {"moe_layers": layers, "top_k": spec.top_k, "num_experts": spec.num_experts, "num_layers": total}
                routes.append(reader(raw, num_tokens=len(p) + len(c), name=f"rollout {i}", **fit))
            logps = [torch.tensor(lp, dtype=torch.float32) for lp in out["logprobs"]]
            self._pending = {"routes": routes, "logps": logps}
            if self.anchor.prior is not None:
                self._pending["labels"] = rollout_labels(self._rows, out["prompt_ids"], out["completion_ids"])
            return out

        return read

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
            for name in ("all", "agreed", "disagreed"):
                if gap[f"{name}_tokens"]:
                    key = "routing/rollout_logp_gap" if name == "all" else f"routing/rollout_logp_gap_{name}"
                    metrics[key].append(gap[name])
