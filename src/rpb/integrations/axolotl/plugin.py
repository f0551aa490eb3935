"""``RpbPlugin``: axolotl's plugin interface (``axolotl.integrations.base.BasePlugin``) carrying rpb's anchor.

Tested against axolotl 0.19.0 (``TESTED_AXOLOTL``; docs/training.md says how to move it). Hooks, in the order
axolotl calls them (``axolotl.cli.config.load_cfg``, ``axolotl.cli.train.do_train``, ``axolotl.train``):

* ``register``: the YAML as written is checked and completed (``read_axolotl_config``) before axolotl
  validates it, so non-reentrant checkpointing is in place before axolotl's default (reentrant) is; with
  ``trust_remote_code``, Moonlight's and the Kimi line's remote tokenizers are made importable
  (``rpb.models.remote_tokenizer_imports``) before axolotl loads one.
* ``load_datasets``: the one ``datasets:`` file is labelled by rpb (``load_labelled`` with axolotl's own
  tokenizer), not tokenized by axolotl, so every token keeps the (sample, span) key of the prior.
* ``post_model_build``: the prior is checked against the base model, tokenizer and data file (the errors of
  ``rpb train``) and the anchor installed; ``post_model_load`` moves it onto a PEFT-wrapped model.
* ``get_trainer_cls`` / ``get_collator_cls_and_kwargs`` / ``get_training_args``: axolotl's trainer class with
  ``AnchorTrainerMixin`` first, ``AnchorCollator``, and ``remove_unused_columns=False``.
* ``add_callbacks_post_trainer``: the run's record (``rpb_run.json``). The trainer attaches ``rpb.monitor`` itself
  (``AnchorTrainerMixin``): asked for by ``rpb: monitor:``, or unasked where the base's routing is at hand.
* ``post_train``: the anchor removed (axolotl calls it before saving): config.json keeps the model's own
  aux-loss values and the weights are plain transformers.
"""

from __future__ import annotations

import json
import logging
from pathlib import Path

from axolotl.common.datasets import TrainDatasetMeta
from axolotl.core.trainers.base import AxolotlTrainer
from axolotl.integrations.base import BasePlugin
from axolotl.loaders.tokenizer import load_tokenizer
from axolotl.utils.trainer import calculate_total_num_steps

from rpb.anchors import AnchorHandle
from rpb.data import AnchorCollator, LabelledData, load_labelled
from rpb.data.arrow import as_dataset
from rpb.data.reasoning import note_reasoning
from rpb.errors import ConfigError
from rpb.fileio import write_text_atomic
from rpb.integrations.axolotl.config import AxolotlRun, read_axolotl_config
from rpb.models import pad_id_of, remote_tokenizer_imports
from rpb.prior.checks import load_prior
from rpb.train.run import attach_anchor
from rpb.train.trainer import AnchorTrainerMixin

logger = logging.getLogger(__name__)

#: the axolotl release the contract test runs against (tests/integrations/axolotl/pins.txt installs it)
TESTED_AXOLOTL = "0.19.0"


class AxolotlAnchorCollator(AnchorCollator):
    """``AnchorCollator`` built the way axolotl builds collators: ``cls(tokenizer, padding=..., pad_to_multiple_of=...,
    return_tensors="pt")``. Rows are padded to the longest in the batch (padding never routes: span
    structural, attention 0), so ``pad_to_multiple_of`` is not applied."""

    def __init__(self, tokenizer, padding=True, pad_to_multiple_of=None, return_tensors="pt", **_ignored):
        super().__init__(pad_id=pad_id_of(tokenizer))


class RpbPlugin(BasePlugin):
    """``plugins: [rpb.integrations.axolotl.RpbPlugin]`` and an ``rpb:`` block (``AxolotlSection``)."""

    def __init__(self):
        super().__init__()
        self.run: AxolotlRun | None = None
        self.tokenizer = None
        self.data: LabelledData | None = None
        self.artifact = None  # the prior, read once when the data is labelled
        self.max_seq_len: int | None = None
        self.handle: AnchorHandle | None = None
        self.info: dict = {}

    def get_input_args(self) -> str:
        return "rpb.integrations.axolotl.config.RpbArgs"

    def register(self, cfg: dict):
        import axolotl

        if axolotl.__version__ != TESTED_AXOLOTL:
            logger.warning("rpb: axolotl %s; the plugin is tested against %s", axolotl.__version__, TESTED_AXOLOTL)
        self.run = read_axolotl_config(cfg)
        if cfg.get("trust_remote_code"):  # before axolotl loads any tokenizer: Moonlight's and Kimi's remote
            remote_tokenizer_imports()  # tokenizer code imports a function axolotl's transformers 5 moved

    def load_datasets(self, cfg, preprocess: bool = False) -> TrainDatasetMeta:
        run = self._run(cfg)
        self.artifact = artifact = load_prior(run.section.prior) if run.section.prior else None
        meta = artifact.metadata if artifact is not None else {}
        self.max_seq_len = meta.get("max_seq_len") or cfg.sequence_len
        if cfg.sequence_len and cfg.sequence_len != self.max_seq_len:
            raise ConfigError(
                "axolotl YAML (rpb plugin)",
                [
                    f"sequence_len: {cfg.sequence_len}, but the prior was collected at max_seq_len {self.max_seq_len} "
                    "(the rows must be cut where the prior's were)"
                ],
            )
        self.tokenizer = load_tokenizer(cfg)
        self.data = load_labelled(
            run.data_jsonl,
            self.tokenizer,
            self.max_seq_len,
            run.section.chat_template_kwargs,
            meta.get("chat_template_date"),
        )
        note_reasoning(self.data.reasoning, self.data.template_settings)
        rows = as_dataset(self.data, run.loss_on)
        return TrainDatasetMeta(train_dataset=rows, total_num_steps=calculate_total_num_steps(cfg, rows))

    def post_model_build(self, cfg, model):
        run = self._run(cfg)
        if self.data is None:
            raise ConfigError(
                "rpb plugin",
                [
                    "the model was loaded before the plugin labelled the data: run "
                    "through axolotl's train entry (axolotl train config.yaml)"
                ],
            )
        self.handle, self.info = attach_anchor(
            model,
            self.tokenizer,
            self.data,
            run.section.anchor,
            self.artifact,
            model_id=cfg.base_model,
            prior_path=run.section.prior or "prior",
            tokenizer_id=cfg.tokenizer_config or cfg.base_model,
            max_seq_len=self.max_seq_len,
            adapter=run.section.adapter,
            progress=False,
            seed=cfg.seed or 42,
        )

    def post_model_load(self, cfg, model):
        if self.handle is not None and model is not self.handle.model:
            # axolotl wrapped the model with its adapter (LoRA): the routers that run are PEFT's
            self.handle = self.handle.reinstall(model)

    def get_trainer_cls(self, cfg):
        plugin = self
        monitor = self._run(cfg).section.monitor

        class AnchoredAxolotlTrainer(AnchorTrainerMixin, AxolotlTrainer):
            """axolotl's trainer carrying the plugin's anchor (and its monitor, ``rpb: monitor:``)."""

            def __init__(self, *args, **kwargs):
                super().__init__(*args, anchor=plugin.handle, monitor=monitor, **kwargs)

        return AnchoredAxolotlTrainer

    def get_collator_cls_and_kwargs(self, cfg, is_eval: bool = False):
        return AxolotlAnchorCollator, {}

    def get_training_args(self, cfg) -> dict:
        return {"remove_unused_columns": False}

    def add_callbacks_post_trainer(self, cfg, trainer) -> list:
        if trainer.args.process_index == 0 and cfg.output_dir:
            Path(cfg.output_dir).mkdir(parents=True, exist_ok=True)
            record = {"axolotl_plugin": {"tested_axolotl": TESTED_AXOLOTL}, **self.info}
            write_text_atomic(Path(cfg.output_dir) / "rpb_run.json", json.dumps(record, indent=2, default=str))
        return []

    def post_train(self, cfg, model):
        if self.handle is not None:  # axolotl calls this twice (after training and at the end); removal is idempotent
            self.handle.remove()

    def _run(self, cfg) -> AxolotlRun:
        if self.run is None:  # a caller that skipped axolotl's load_cfg: read the validated mapping instead
            self.run = read_axolotl_config(cfg)
        return self.run
