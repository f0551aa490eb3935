"""PR2 in rpb's ``GRPOTrainer`` (``GRPOConfig.replay="PR2"``; the math in ``rpb.replay.predictive``, docs/rl.md).

``PredictiveReplay`` is a mixin of ``rpb.integrations.trl.grpo.GRPOTrainer`` (before TRL's class in its bases).
PR2 is R2 with its recorded routes chosen ahead of the drift:

1. the first training-side forward of a generation batch (rpb's forced R2 forward, no gradients) routes every
   token to the family's selection on its router logits plus the predictor's correction, gates from the unbiased
   logits, and keeps each router's input and logits at the completion positions;
2. every training forward replays those routes (``rpb_pr2_routes``), as R2 replays the first forward's own;
3. from the batch's second update on (the policy has moved: the router's live distribution differs from the
   recorded one), the predictor learns by ``predictor_loss`` on the micro-batch's completion tokens; in the first
   update live and recorded are the same weights, and the reference skips it too.

The predictor is a module beside the model: an optimizer group of its own at ``learning_rate x pr2_lr_scale``
(the reference's ``alpha``), saved and restored with the optimizer in every checkpoint
(``rpb_pr2_predictor.safetensors``), never in the model's weights.

**Several processes.** The predictor sits outside the DDP / FSDP wrapper, so its gradients are not averaged for
it: each rank's loss is its own tokens' sum over the ranks' token count (all-reduced), and the gradients are
summed over the ranks before every optimizer step, so every rank takes the one step a single process would take on
all the ranks' rows (a test against one process).
"""

from __future__ import annotations

from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

from rpb.errors import ConfigError
from rpb.replay.predictive import RoutePredictor, predictor_loss

#: the predictor's file in a checkpoint folder
PREDICTOR_FILE = "rpb_pr2_predictor.safetensors"
#: what the first forward leaves in TRL's batch dict for PR2: the routes to replay, and what the predictor learns
#: from (router inputs [B, C, L, H] in the model's dtype, logits [B, C, L, E] float32)
PR2_ROUTES, PR2_INPUTS, PR2_LOGITS = "rpb_pr2_routes", "rpb_pr2_inputs", "rpb_pr2_logits"


class PredictiveReplay:
    """PR2's predictor, its optimizer group, its loss term and its checkpoint file (see the module docstring)."""

    pr2: RoutePredictor | None = None

    def _build_predictor(self) -> None:
        """The zero predictor, one linear per MoE layer, on the routers' device (``replay_mode`` PR2 only)."""
        if self.replay_mode != "PR2":
            return
        routers = [m.router.weight for m in self.replay.layers]
        widths = [int(w.shape[1]) for w in routers]
        experts = [spec.num_experts for spec in self.replay.specs]
        self.pr2 = RoutePredictor(widths, experts).to(routers[0].device)

    def create_optimizer(self, model=None):
        optimizer = super().create_optimizer(model)
        if self.pr2 is not None and not any(g.get("rpb_pr2") for g in optimizer.param_groups):
            lr = self.args.learning_rate * self.args.pr2_lr_scale
            group = {"params": list(self.pr2.parameters()), "lr": lr, "weight_decay": 0.0, "rpb_pr2": True}
            optimizer.add_param_group(group)
            # the Trainer zeroes the model's gradients (model.zero_grad), never the optimizer's: the predictor's
            # would pile up over every step without this
            optimizer.register_step_post_hook(lambda *_: self.pr2.zero_grad(set_to_none=True))
            if self.accelerator.num_processes > 1:
                optimizer.register_step_pre_hook(lambda *_: self._sum_predictor_grads())
        return optimizer

    def _sum_predictor_grads(self) -> None:
        """The predictor's gradients summed over the ranks (each rank's loss is already its share of the whole)."""
        import torch.distributed as dist

        for param in self.pr2.parameters():
            if param.grad is not None:
                dist.all_reduce(param.grad, op=dist.ReduceOp.SUM)

    def _save_optimizer_and_scheduler(self, output_dir: str) -> None:
        super()._save_optimizer_and_scheduler(output_dir)
        if self.pr2 is not None and self.args.should_save:
            state = {k: v.detach().cpu().contiguous() for k, v in self.pr2.state_dict().items()}
            save_file(state, str(Path(output_dir) / PREDICTOR_FILE))

    def _load_optimizer_and_scheduler(self, checkpoint: str | None) -> None:
        super()._load_optimizer_and_scheduler(checkpoint)
        if self.pr2 is None or checkpoint is None:
            return
        path = Path(checkpoint) / PREDICTOR_FILE
        if not path.is_file():
            raise ConfigError(
                "rpb.integrations.trl.GRPOTrainer",
                [
                    f"replay='PR2' resumed from {checkpoint}: it holds no {PREDICTOR_FILE} (a run without PR2's "
                    "predictor); resuming would restart the predictor from zero"
                ],
            )
        state = load_file(str(path))
        with torch.no_grad():
            for name, tensor in self.pr2.state_dict().items():
                if name not in state or state[name].shape != tensor.shape:
                    raise ConfigError(
                        "rpb.integrations.trl.GRPOTrainer",
                        [
                            f"{path}: {name} of shape {tuple(state[name].shape) if name in state else 'absent'}, the "
                            f"model's predictor has {tuple(tensor.shape)}"
                        ],
                    )
                tensor.copy_(state[name])

    def _train_predictor(self, micro: dict) -> None:
        """The predictor's loss on this micro-batch, back-propagated on its own (nothing in a batch's first update,
        or without PR2): its gradient reaches the predictor alone, and TRL's logged ``loss`` stays GRPO's, comparable
        across replay modes. Scaled to one optimizer step; logged as ``pr2/loss``."""
        if self.pr2 is None or micro["update"] < 1:
            return
        inputs = micro["inputs"]
        count_BC = inputs["completion_mask"].bool()
        if "tool_mask" in inputs:
            count_BC = count_BC & inputs["tool_mask"].bool()
        live_BCLE, transform = self.replay.kept_BCLE, self.anchor.router_transform
        loss = predictor_loss(self.pr2, inputs[PR2_INPUTS], inputs[PR2_LOGITS], live_BCLE, count_BC, transform)
        self._metrics["train"]["pr2/loss"].append(float(loss.detach()))
        share = 1.0
        if self.accelerator.num_processes > 1:  # this rank's tokens over every rank's: the gradients are summed
            mine = count_BC.sum().to(self.accelerator.device, torch.float64)
            share = float(mine / self.accelerator.reduce(mine.clone(), reduction="sum").clamp_min(1))
        self.accelerator.backward(loss * share / self.current_gradient_accumulation_steps)
