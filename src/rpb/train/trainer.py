"""The Hugging Face Trainer with an installed anchor: the per-token (sample, span) context around each step,
the anchor's loss term, its routing statistics in the logs, and ``log.jsonl``.

``AnchorTrainer`` is usable on its own inside a user's Trainer set-up (or its logic copied into TRL's
SFTTrainer / an Accelerate loop: set the step context around forward *and* backward, add ``handle.loss()``);
``rpb.train.run`` builds one for ``rpb train``.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
from transformers import PreTrainedModel, Trainer, TrainerCallback

from rpb.anchors import AnchorHandle
from rpb.anchors.stats import reduce_across_ranks, routing_metrics
from rpb.experts.masks import ExpertMask
from rpb.monitor.routing import MonitorConfig
from rpb.train.hold import HoldingTrainer


class AnchorTrainerMixin(HoldingTrainer):
    """Makes a Trainer's steps carry the per-token (sample, span) context and add the anchor's loss.

    Mix it in before a ``transformers.Trainer`` subclass and pass ``anchor=handle`` (for TRL's
    ``SFTTrainer`` use ``rpb.integrations.trl``, which also fixes TRL's data handling and its
    auxiliary loss). Batches must hold ``rpb_sample_index`` and ``rpb_span`` (``AnchorCollator``
    makes them); they are taken out before the model sees the batch. The context stays set
    through backward, so gradient checkpointing recomputes with the same bias.
    """

    def __init__(
        self,
        *args,
        anchor: AnchorHandle,
        expert_mask: ExpertMask | None = None,
        monitor: MonitorConfig | None = None,
        **kwargs,
    ):
        super().__init__(*args, **kwargs)
        self.anchor = anchor
        self.expert_mask = expert_mask
        self._anchor_terms: list[float] = []
        # routing-kd: the step's overlap with the base, a target's λ; the monitor (rpb.train.hold)
        self.hold_routing(monitor)

    def create_optimizer(self, model=None):
        optimizer = super().create_optimizer(model)
        if self.expert_mask is not None:  # weight decay kept off the experts train.only_experts leaves out
            self.expert_mask.restrict_decay(optimizer)
        return optimizer

    @staticmethod
    def _token_keys(inputs: dict) -> tuple[torch.Tensor, torch.Tensor]:
        missing = [k for k in ("rpb_sample_index", "rpb_span") if k not in inputs]
        if missing:
            raise KeyError(
                f"the batch has no {missing}: the anchor needs every token's (sample, span); use "
                f"rpb.data.AnchorCollator as the data collator (this batch has {sorted(inputs)})"
            )
        return inputs.pop("rpb_sample_index"), inputs.pop("rpb_span")

    def training_step(self, model, inputs, num_items_in_batch=None):
        sample_BT, span_BT = self._token_keys(inputs)
        self.anchor.record_stats = True  # every step of the logging window counts (rpb.anchors.stats)
        self._sample_BT = sample_BT  # the rows the base's stored routes are read by (compute_loss)
        with self.anchor.step(sample_BT, span_BT, inputs.get("attention_mask")):
            return super().training_step(model, inputs, num_items_in_batch)

    def prediction_step(self, model, inputs, prediction_loss_only, ignore_keys=None):
        # evaluation never sees the anchor (eval mode); the keys only have to leave the batch
        inputs = {k: v for k, v in inputs.items() if k not in ("rpb_sample_index", "rpb_span")}
        return super().prediction_step(model, inputs, prediction_loss_only, ignore_keys)

    def get_batch_samples(self, epoch_iterator, num_batches, device):
        # A resume from the run's final checkpoint (a kill between its last save and the final one):
        # the Trainer (5.0 to 5.24) enters the epoch that holds step max_steps and takes a step before it
        # checks max_steps, so one more step would train and checkpoint-<max_steps + 1> appear. No
        # batches: nothing trains, and the weights saved are the checkpoint's.
        if self.state.global_step >= self.state.max_steps > 0:
            return [], None
        return super().get_batch_samples(epoch_iterator, num_batches, device)

    def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
        # the base's routing first (routing-kd, output-kd): the batch is on its device here, inside the step
        ctx = self.anchor._context
        output_kd = model.training and self.anchor.method.teacher == "output"
        if model.training and ctx is not None and self.anchor.teacher is not None:
            ctx.base = self.anchor.base_routing(inputs, self._sample_BT)
        labels = inputs.get("labels")
        # ``return_outputs`` passes through: TRL's SFTTrainer runs a second forward to build logits when asked
        result = super().compute_loss(model, inputs, return_outputs or output_kd, num_items_in_batch)
        loss, outputs = result if (return_outputs or output_kd) else (result, None)
        if model.training and (self.anchor.method.loss is not None or output_kd):
            term = self.anchor.loss() if not output_kd else self._output_kd(outputs, labels, ctx)
            self._anchor_terms.append(float(term.detach()))
            loss = loss + term / self._anchor_divisor(num_items_in_batch)
        return (loss, outputs) if return_outputs else loss

    def _output_kd(self, outputs, labels, ctx) -> torch.Tensor:
        """output-kd's term: lambda x KL(base next-token distribution || the model's) over the loss's tokens."""
        from rpb.losses import output_kd

        if labels is None or ctx is None or ctx.base is None or ctx.base.output_BTV is None:
            raise RuntimeError(
                "output-kd: the step has no labels or no base forward (anchor.base=online); the loss's tokens and "
                "the base's next-token distribution are both needed"
            )
        return self.anchor.config.lambda_ * output_kd(outputs.logits, ctx.base.output_BTV, labels)

    def _anchor_divisor(self, num_items_in_batch) -> int:
        """The anchor's term is a per-micro-batch mean: over an accumulated batch it must count once,
        so it is divided by the accumulation steps. The Trainer divides the returned loss by them
        itself only when the model's loss is not already normalised over the whole accumulated batch;
        when it is, the division is ours."""
        # the attribute is newer than transformers 5.16 (axolotl's pin), whose Trainer applies the rule below
        scaled = getattr(self, "loss_is_scaled_for_ga", None)
        if scaled is None:
            scaled = (self.model_accepts_loss_kwargs and num_items_in_batch is not None) or bool(self.compute_loss_func)
        return self.current_gradient_accumulation_steps if scaled else 1

    def _load_from_checkpoint(self, resume_from_checkpoint, model=None):
        super()._load_from_checkpoint(resume_from_checkpoint, model)
        model = model or self.model
        ckpt = Path(resume_from_checkpoint)
        saved_whole = any((ckpt / n).is_file() for n in ("model.safetensors", "model.safetensors.index.json"))
        if self.is_fsdp_enabled or not isinstance(model, PreTrainedModel) or not saved_whole:
            return
        # transformers (5.24) saves fused MoE experts converted to per-expert tensors, and the Trainer
        # loads the file back without converting: the experts would silently keep their pre-resume
        # weights. from_pretrained converts; its weights replace the partial load
        saved = type(model).from_pretrained(ckpt, dtype=model.dtype)
        model.load_state_dict(saved.state_dict(), strict=True)
        del saved

    def log(self, logs: dict, *args, **kwargs):
        if "loss" in logs:
            if self._anchor_terms:
                logs["anchor_loss"] = sum(self._anchor_terms) / len(self._anchor_terms)
                self._anchor_terms = []
            # every rank calls log() (the Trainer gathers the loss first), so the counts can be summed here
            stats = reduce_across_ranks(self.anchor.reset_stats())
            index = {pos: layer.moe.layer_index for pos, layer in enumerate(self.anchor.layers)}
            method = self.anchor.method
            figures = dict(loss=method.loss is not None, base=method.needs_base_router, prior=method.needs_prior)
            logs.update(routing_metrics(stats, index, **figures))
            logs.update(self.hold_logs())
        super().log(logs, *args, **kwargs)


class AnchorTrainer(AnchorTrainerMixin, Trainer):
    """``transformers.Trainer`` with an installed anchor (see ``AnchorTrainerMixin``)."""


class JsonlLog(TrainerCallback):
    """Every log record, one JSON object per line, in ``output_dir/log.jsonl`` (main process)."""

    def __init__(self, path: Path):
        self.path = path

    def on_log(self, args, state, control, logs=None, **kwargs):
        if state.is_world_process_zero and logs:
            with open(self.path, "a", encoding="utf-8") as f:
                f.write(json.dumps({"step": state.global_step, **logs}) + "\n")
