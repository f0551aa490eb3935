"""TRL's ``SFTTrainer`` with an rpb anchor: ``from rpb.integrations.trl import SFTConfig, SFTTrainer``.

Install with ``pip install 'rpb[trl]'`` (torch pinned as a constraint, see the README). What this
module changes about TRL, and why:

* **Data.** Rows are labelled by rpb (``rpb.data.load_labelled``), so every token's (sample, span)
  is the key the prior was collected under. TRL must neither re-tokenize them nor drop the
  per-token columns: dataset preparation is skipped, ``span_ids`` / ``sample_index`` are kept as
  signature columns, and ``rpb.data.AnchorCollator`` builds the batches.
* **No native auxiliary loss, under any method.** TRL adds the model's own load-balancing loss
  whenever ``router_aux_loss_coef`` is unset and the config declares one (0.001 for Qwen3-MoE), and
  it turns ``output_router_logits`` back on after ``install_anchor`` turned it off. That would put a
  hidden load-balancing term into every ``rpb`` and ``sft`` run. Here the coefficient is 0.0 (logged
  once); a non-zero value is refused: rpb's ``lbl`` is ``anchor.method=lbl``. The saved
  ``config.json`` keeps the model's own values.
* **Packing.** ``packing=True`` (or ``padding_free=True``) concatenates each micro-batch's examples
  into one row without padding, positions restarting at every example, and no attention mask:
  transformers then keeps attention inside each example (flash-attention varlen, or a block mask
  for sdpa / eager), and every token keeps its own (sample, span), so the bias is the unpacked one.
  Examples are not split or re-grouped to ``max_length`` (TRL's "bfd" / "wrapped").
* **Checkpointing.** The loss anchors need non-reentrant activation checkpointing (reentrant runs
  the first forward without gradients); reentrant with a loss anchor -- which TRL forces for PEFT
  with DeepSpeed ZeRO-3 -- is refused when the trainer is built, not at step 1.

The checkpoint ``save_model`` writes is plain transformers (the anchor is forward hooks only).
"""

from __future__ import annotations

import contextlib
import logging
from dataclasses import dataclass, field

import trl

from rpb.anchors import AnchorConfig, AnchorHandle
from rpb.data import AnchorCollator, LabelledData, LossOn, load_labelled
from rpb.data.arrow import RPB_COLUMNS, as_dataset
from rpb.errors import ConfigError
from rpb.models import pad_id_of
from rpb.prior.checks import load_prior
from rpb.train.run import attach_anchor
from rpb.train.trainer import AnchorTrainerMixin

logger = logging.getLogger(__name__)

_TOLD = False  # the aux-loss note is logged once per process


@dataclass
class SFTConfig(trl.SFTConfig):
    """TRL's ``SFTConfig`` with the defaults an anchored run needs (every other field is TRL's).

    ``router_aux_loss_coef`` defaults to 0.0 (TRL: the model config's own coefficient) and only
    0.0 is accepted; activation checkpointing defaults to ``{"use_reentrant": False}``.
    """

    router_aux_loss_coef: float | None = field(
        default=0.0,
        metadata={"help": "must stay 0.0: rpb adds no native load-balancing loss (use anchor.method=lbl)"},
    )

    def __post_init__(self):
        # transformers 5 calls them activation_checkpointing*; the older names are deprecated aliases
        name = "activation_checkpointing_kwargs" if hasattr(self, "activation_checkpointing_kwargs") else None
        if name and getattr(self, name) is None and self.gradient_checkpointing_kwargs is None:
            setattr(self, name, {"use_reentrant": False})
        elif self.gradient_checkpointing_kwargs is None and not name:
            self.gradient_checkpointing_kwargs = {"use_reentrant": False}
        super().__post_init__()


def hold_native_aux_off(args) -> None:
    """Set TRL's ``router_aux_loss_coef`` to 0.0 (its ``None`` means the model config's own coefficient), said
    once per process: no native load-balancing loss under any rpb method, in SFT or RL."""
    global _TOLD
    if not _TOLD:
        was = " (set by rpb: TRL's unset value means the model config's)" if args.router_aux_loss_coef is None else ""
        logger.warning(
            "rpb: router_aux_loss_coef=0.0%s; no native load-balancing loss under any method, "
            "rpb's own is anchor.method=lbl",
            was,
        )
        _TOLD = True
    args.router_aux_loss_coef = 0.0


def _checkpointing(args) -> tuple[bool, bool]:
    """(checkpointing on, reentrant) as the Trainer will apply them (transformers 5 renamed the fields)."""
    on = bool(getattr(args, "activation_checkpointing", None) or getattr(args, "gradient_checkpointing", False))
    kwargs = getattr(args, "activation_checkpointing_kwargs", None) or args.gradient_checkpointing_kwargs or {}
    return on, bool(kwargs.get("use_reentrant", False)) if isinstance(kwargs, dict) else False


def _problems(args, anchor: AnchorHandle, data_collator) -> list[str]:
    out = []
    coef = args.router_aux_loss_coef
    if coef not in (None, 0.0):
        out.append(
            f"router_aux_loss_coef={coef}: rpb runs add no native load-balancing loss (it would contaminate every "
            "method, sft included); for a load-balancing anchor use anchor.method=lbl with anchor.lbl_coef"
        )
    on, reentrant = _checkpointing(args)
    if on and reentrant and anchor.method.loss is not None:
        out.append(
            f"gradient checkpointing with use_reentrant=True: anchor.method={anchor.method.name} adds a loss term, "
            "and reentrant checkpointing runs the first forward without gradients, so the term could not train "
            'the routers; set gradient_checkpointing_kwargs={"use_reentrant": False} (with PEFT + DeepSpeed '
            "ZeRO-3, TRL forces reentrant: use ZeRO-2 or FSDP there)"
        )
    if data_collator is not None and not isinstance(data_collator, AnchorCollator):
        out.append(
            f"data_collator={type(data_collator).__name__}: the anchor needs every token's (sample, span), which "
            "only rpb.data.AnchorCollator carries (leave data_collator unset)"
        )
    if args.packing and args.packing_strategy == "wrapped":
        out.append("packing_strategy='wrapped' splits examples across rows; rpb packs whole examples (leave it 'bfd')")
    return out


class SFTTrainer(AnchorTrainerMixin, trl.SFTTrainer):
    """TRL's ``SFTTrainer`` carrying an installed anchor (``anchor=handle``, see ``prepare``).

    With ``peft_config`` (``pip install 'rpb[peft]'``) TRL wraps the model; the anchor then moves
    onto the wrapped model (``self.anchor``: remove that one after training).

    ``train_dataset`` is rpb's labelled rows (see ``as_dataset``); ``loss_on`` picks the tokens of
    the language-model loss ("answer": assistant content and its turn end, as ``rpb train``).
    Everything else is TRL's, except what the module docstring lists.
    """

    def __init__(
        self,
        model,
        args: trl.SFTConfig,
        train_dataset,
        *,
        anchor: AnchorHandle,
        loss_on: LossOn = "answer",
        data_collator=None,
        processing_class=None,
        **kwargs,
    ):
        problems = _problems(args, anchor, data_collator)
        if problems:
            raise ConfigError("rpb.integrations.trl.SFTTrainer", problems)
        if processing_class is None:
            raise ConfigError("SFTTrainer", ["processing_class: the tokenizer the rows were labelled with"])
        hold_native_aux_off(args)
        args.dataset_kwargs = {**(args.dataset_kwargs or {}), "skip_prepare_dataset": True}
        packed = bool(args.packing or args.padding_free)
        text_config = model.config.get_text_config()
        # the model's own values, written back into every saved config.json
        self._native_aux = {
            k: getattr(text_config, k)
            for k in ("output_router_logits", "router_aux_loss_coef")
            if hasattr(text_config, k)
        }
        if "output_router_logits" in self._native_aux:
            self._native_aux["output_router_logits"] = anchor.native_output_router_logits
        collator = data_collator or AnchorCollator(pad_id=pad_id_of(processing_class), padding_free=packed)
        # TRL's own packing needs its collator, which would drop the per-token keys: rpb's collator packs instead
        saved = args.packing, args.padding_free
        args.packing = args.padding_free = False
        if kwargs.get("eval_dataset") is not None:
            kwargs["eval_dataset"] = as_dataset(kwargs["eval_dataset"], loss_on)
        try:
            rows = as_dataset(train_dataset, loss_on)
            super().__init__(
                model=model,
                args=args,
                train_dataset=rows,
                data_collator=collator,
                processing_class=processing_class,
                anchor=anchor,
                **kwargs,
            )
        finally:
            args.packing, args.padding_free = saved
        if self.model is not anchor.model:
            # TRL wrapped the model with ``peft_config``: the routers that run are PEFT's (a copy under
            # modules_to_save, a LoRA-wrapped weight), so the anchor moves onto the wrapped model
            anchor = anchor.reinstall(self.model)
            self.rebind_anchor(anchor)
        on, reentrant = _checkpointing(self.args)
        if on and reentrant and anchor.method.loss is not None:  # TRL may have forced it (PEFT + ZeRO-3)
            raise ConfigError("SFTTrainer (after TRL's set-up)", _problems(self.args, anchor, None))

    def _set_signature_columns_if_needed(self):
        super()._set_signature_columns_if_needed()
        self._signature_columns = list(dict.fromkeys([*self._signature_columns, *RPB_COLUMNS]))

    @contextlib.contextmanager
    def _native_config(self):
        text_config = self.model.config.get_text_config()
        during = {k: getattr(text_config, k) for k in self._native_aux}
        for k, v in self._native_aux.items():
            setattr(text_config, k, v)
        try:
            yield
        finally:
            for k, v in during.items():
                setattr(text_config, k, v)

    def _save(self, output_dir=None, state_dict=None):
        with self._native_config():
            super()._save(output_dir, state_dict)


def prepare(
    model,
    tokenizer,
    data_jsonl: str,
    anchor: AnchorConfig,
    prior: str | None = None,
    *,
    max_seq_len: int | None = None,
    model_id: str | None = None,
    chat_template_kwargs: dict | None = None,
) -> tuple[AnchorHandle, LabelledData]:
    """Label the data file, check the prior against it and the model (the errors of ``rpb train``),
    and install the anchor; returns ``(handle, rows)`` for ``SFTTrainer(..., train_dataset=rows,
    anchor=handle)``. Call ``handle.remove()`` after training. ``chat_template_kwargs``: the template's keyword
    arguments (``{"enable_thinking": True}``), which must be the prior's."""
    artifact = load_prior(prior) if prior else None
    max_seq_len = max_seq_len or (artifact.metadata["max_seq_len"] if artifact is not None else None)
    if max_seq_len is None:
        raise ConfigError("prepare", ["max_seq_len: required when there is no prior to read it from"])
    date = artifact.metadata.get("chat_template_date") if artifact is not None else None
    data = load_labelled(data_jsonl, tokenizer, max_seq_len, chat_template_kwargs, date)
    name = model_id or getattr(model.config, "_name_or_path", "") or type(model).__name__
    handle, _ = attach_anchor(
        model,
        tokenizer,
        data,
        anchor,
        artifact,
        model_id=name,
        prior_path=prior or "prior",
        max_seq_len=max_seq_len,
        progress=False,
    )
    return handle, data
