"""The ``rpb:`` block of an axolotl YAML, and what the rest of that YAML must say for an anchored run.

Pure (no axolotl import): the plugin calls ``read_axolotl_config`` from its ``register`` hook, on the YAML as
written, before axolotl validates and normalises it, so every problem is listed at once and the settings
rpb needs are in place before axolotl fills in its own defaults.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from pydantic import BaseModel, Field

from rpb.anchors.config import AnchorConfig
from rpb.anchors.methods import METHODS
from rpb.errors import ConfigError
from rpb.monitor.routing import MonitorConfig
from rpb.train.config import anchor_problems, build_section

#: the keys of a ``datasets:`` entry the plugin reads; axolotl's per-dataset prompt options (field_messages,
#: roles_to_train, message_property_mappings, ...) would be ignored by rpb's labelling, so they are refused
DATASET_KEYS = ("path", "type", "ds_type")
#: axolotl settings that would replace rpb's trainer, sampler or collator, each with why
REPLACES_RPB = {
    "sample_packing": "axolotl's multipack sampler and collator drop rpb's per-token (sample, span) keys",
    "trainer_cls": "rpb's plugin supplies the trainer class (axolotl's own, with the anchor mixed in)",
    "rl": "the plugin anchors supervised fine-tuning only",
    "reward_model": "the plugin anchors supervised fine-tuning only",
    "process_reward_model": "the plugin anchors supervised fine-tuning only",
    "batch_flattening": "axolotl's flattening collator drops rpb's per-token keys",
    "pretraining_dataset": "the rows must be the labelled conversations the prior was collected on",
    "test_datasets": "evaluation data is not supported through the plugin yet",
}


@dataclass
class AxolotlSection:
    """The ``rpb:`` block (every other key of the YAML is axolotl's). The data file is the one
    ``datasets:`` names; its rows are labelled by rpb, not tokenized by axolotl."""

    #: the prior collected on the base model and that data file (``rpb collect``); required by the
    #: prior-based methods
    prior: str | None = None
    anchor: AnchorConfig = field(default_factory=AnchorConfig)
    #: the chat template's keyword arguments (``enable_thinking: true``); must equal the prior's
    chat_template_kwargs: dict = field(default_factory=dict)
    #: the adapter for the model type (``rpb.adapters``); None: the model's own ``model_type``
    adapter: str | None = None
    #: ``rpb.monitor`` against the frozen base routers (``MonitorConfig`` fields, or true / false for ``enabled``;
    #: a mapping asks for it); unasked, on where the base's routing is at hand (``routing-kd``), as in ``rpb train``
    monitor: MonitorConfig = field(default_factory=MonitorConfig)


class RpbArgs(BaseModel):
    """The ``rpb:`` key in axolotl's config schema (axolotl merges a plugin's pydantic model into its own, and
    would drop an undeclared key). Only declared here: ``AxolotlSection`` checks it, naming each field."""

    rpb: dict[str, Any] | None = Field(
        default=None,
        json_schema_extra={"description": "rpb's anchor: {prior, anchor, chat_template_kwargs, adapter, monitor}"},
    )


@dataclass
class AxolotlRun:
    """What the plugin needs from the whole YAML, read once."""

    section: AxolotlSection
    data_jsonl: str
    #: ``train_on_inputs: true`` trains on the whole conversation (rpb's ``loss_on: all``)
    loss_on: str


def _truthy(cfg: dict, key: str) -> bool:
    return bool(cfg.get(key))


def _section(raw, problems: list[str]) -> AxolotlSection:
    if raw is None:
        problems.append("rpb: required (the prior and the anchor: rpb: {prior: ..., anchor: {method: rpb}})")
        return AxolotlSection()
    if not isinstance(raw, dict):
        problems.append(f"rpb: expected a mapping, got {type(raw).__name__}")
        return AxolotlSection()
    raw = dict(raw)
    monitor = raw.pop("monitor", None)
    section = build_section(AxolotlSection, raw, problems, "rpb.")
    if isinstance(monitor, bool):
        section.monitor = MonitorConfig(enabled=monitor)
    elif isinstance(monitor, dict):  # a mapping asks for the monitor, unless it says enabled: false
        section.monitor = build_section(MonitorConfig, {"enabled": True, **monitor}, problems, "rpb.monitor.")
    elif monitor is not None:
        problems.append(f"rpb.monitor: expected a mapping of MonitorConfig fields, true or false, got {monitor!r}")
    problems += anchor_problems(section.anchor, section.prior, "rpb.")
    return section


def _data_file(cfg: dict, problems: list[str]) -> str:
    entries = cfg.get("datasets")
    if not isinstance(entries, list) or len(entries) != 1 or not isinstance(entries[0], dict):
        problems.append(
            "datasets: exactly one entry, the JSONL file the prior was collected on ({path: data.jsonl}), "
            f"got {entries!r}"
        )
        return ""
    entry = entries[0]
    extra = sorted(set(entry) - set(DATASET_KEYS))
    if extra:
        problems.append(
            f"datasets[0]: {extra} would be ignored: rpb labels every row with the tokenizer's own chat "
            f"template, as the prior was collected (keys read: {list(DATASET_KEYS)})"
        )
    if entry.get("type", "chat_template") != "chat_template":
        problems.append(f"datasets[0].type: chat_template (rows of messages), got {entry.get('type')!r}")
    path = entry.get("path")
    if not isinstance(path, str) or not Path(path).is_file():
        problems.append(f"datasets[0].path: a local JSONL file (the prior's data file), got {path!r}")
        return ""
    return path


def _contradictions(cfg: dict, section: AxolotlSection) -> list[str]:
    out = [f"{key}: {why}" for key, why in REPLACES_RPB.items() if _truthy(cfg, key)]
    if cfg.get("val_set_size") not in (None, 0, 0.0):
        out.append(f"val_set_size: {cfg['val_set_size']}: evaluation data is not supported through the plugin yet")
    if cfg.get("remove_unused_columns"):
        out.append("remove_unused_columns: true would drop rpb's span_ids / sample_index columns")
    overrides = cfg.get("overrides_of_model_config") or {}
    if overrides.get("output_router_logits"):
        out.append(
            "overrides_of_model_config.output_router_logits: true adds the model's native load-balancing loss "
            "to every method, sft included; rpb's is anchor.method=lbl with anchor.lbl_coef"
        )
    if overrides.get("router_aux_loss_coef") not in (None, 0, 0.0):
        out.append(
            f"overrides_of_model_config.router_aux_loss_coef: {overrides['router_aux_loss_coef']}: rpb runs add no "
            "native load-balancing loss; use anchor.method=lbl with anchor.lbl_coef"
        )
    kwargs = cfg.get("gradient_checkpointing_kwargs") or {}
    method = METHODS.get(section.anchor.method)
    if kwargs.get("use_reentrant") and method is not None and method.loss is not None:
        out.append(
            f"gradient_checkpointing_kwargs.use_reentrant: true: anchor.method={method.name} adds a loss term, and "
            "reentrant checkpointing runs the first forward without gradients, so the term could not train the "
            "routers (leave it unset: the plugin sets false)"
        )
    return out


def read_axolotl_config(cfg: dict) -> AxolotlRun:
    """Check an axolotl YAML (as a mapping, before axolotl's validation) for an anchored run and put in
    what rpb needs: non-reentrant activation checkpointing (axolotl's default is reentrant) and
    ``remove_unused_columns: false``. Raises ``ConfigError`` listing every problem."""
    problems: list[str] = []
    section = _section(cfg.get("rpb"), problems)
    data = _data_file(cfg, problems)
    problems += _contradictions(cfg, section)
    if problems:
        raise ConfigError("axolotl YAML (rpb plugin)", problems)
    if _truthy(cfg, "gradient_checkpointing") and not cfg.get("gradient_checkpointing_kwargs"):
        cfg["gradient_checkpointing_kwargs"] = {"use_reentrant": False}
    cfg["remove_unused_columns"] = False
    return AxolotlRun(section, data, "all" if _truthy(cfg, "train_on_inputs") else "answer")
