"""An axolotl plugin the contract test lists after rpb's: it records what the run did, for the test to check.

Runs inside axolotl's own process (``python -m axolotl.cli.train``), so it may import axolotl; the test
process never imports this file. Written to ``output_dir/record.json`` at ``post_train``:

* every training batch's tokens and per-token (sample, span), as the collator axolotl built made them;
* every training forward's router outputs after rpb's hook (logits and the chosen expert sets), with each
  router's expert-correction bias, for the test to redo the selection by hand from the prior;
* every log record, and facts the test checks: versions, the trainer's classes, the collator, the training
  arguments axolotl built, and the model config's native aux-loss switch while training.
"""

from __future__ import annotations

import json
from pathlib import Path

import axolotl
import transformers
from axolotl.integrations.base import BasePlugin
from transformers import TrainerCallback


def routers(model) -> list:
    return [m for name, m in model.named_modules() if name.endswith("mlp.gate")]


class _Logs(TrainerCallback):
    def __init__(self, record: dict):
        self.record = record

    def on_train_begin(self, args, state, control, model=None, **kwargs):
        self.record["output_router_logits_while_training"] = getattr(model.config, "output_router_logits", None)

    def on_log(self, args, state, control, logs=None, **kwargs):
        self.record["logs"].append(dict(logs or {}))


class RecordRouting(BasePlugin):
    def __init__(self):
        super().__init__()
        self.record: dict = {"batches": [], "forwards": [], "logs": []}

    def post_trainer_create(self, cfg, trainer):
        collate = trainer.data_collator

        def keep_batch(features):
            batch = collate(features)
            self.record["batches"].append(
                {
                    "sample": batch["rpb_sample_index"].tolist(),
                    "span": batch["rpb_span"].tolist(),
                    "input_ids": batch["input_ids"].tolist(),
                    "attention_mask": batch["attention_mask"].tolist(),
                }
            )
            return batch

        trainer.data_collator = keep_batch
        moe = routers(trainer.model)

        def hook(module, args, out):
            if module.training:
                forwards = self.record["forwards"]
                if not forwards or len(forwards[-1]) == len(moe):
                    forwards.append([])
                bias = getattr(module, "e_score_correction_bias", None)
                forwards[-1].append({
                    "logits": out[0].detach().float().tolist(),
                    "chosen": [sorted(r) for r in out[2].tolist()],
                    "expert_bias": None if bias is None else bias.tolist(),
                })  # fmt: skip

        for r in moe:
            r.register_forward_hook(hook)
        args = trainer.args
        self.record["facts"] = {
            "entry": "axolotl.cli.train (axolotl's own train entry, on a YAML)",
            "axolotl": axolotl.__version__,
            "transformers": transformers.__version__,
            "trainer_mro": [c.__name__ for c in type(trainer).__mro__],
            "collator": type(collate).__name__,
            "remove_unused_columns": args.remove_unused_columns,
            "gradient_checkpointing": bool(args.gradient_checkpointing),
            "gradient_checkpointing_kwargs": args.gradient_checkpointing_kwargs,
            "routers": len(moe),
        }

    def add_callbacks_post_trainer(self, cfg, trainer):
        return [_Logs(self.record)]

    def post_train(self, cfg, model):
        Path(cfg.output_dir, "record.json").write_text(json.dumps(self.record, default=str))
