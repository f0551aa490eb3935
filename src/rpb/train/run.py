"""``rpb train``: post-training with an anchor under the Hugging Face Trainer.

``run_training`` is the whole ``rpb train`` job: check the prior against the model and data, install the
anchor, train, remove the anchor, save a plain HF checkpoint. The Trainer with the anchor's step context
(``AnchorTrainer``, ``AnchorTrainerMixin``) lives in ``rpb.train.trainer``.
"""

from __future__ import annotations

import contextlib
import dataclasses
import gc
import json
import logging
import os
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
from transformers import TrainerCallback, TrainingArguments, set_seed
from transformers.trainer_callback import PrinterCallback

from rpb.adapters import find_moe_layers, get_adapter, routers_sha256
from rpb.anchors import AnchorConfig, AnchorHandle, RunFacts, get_method, install_anchor, verify_prior
from rpb.anchors.controls import base_communities, base_transition_communities, layer_permutations
from rpb.anchors.transform import run_transform
from rpb.data import AnchorCollator, ChatTemplate, ExampleDataset, LabelledData, file_sha256, load_labelled
from rpb.data.dataset import note_truncated
from rpb.data.reasoning import note_reasoning
from rpb.errors import ArgumentError
from rpb.experts.masks import ExpertMask
from rpb.fileio import write_text_atomic
from rpb.kernels import SORTED_EXPERTS, TokenMask
from rpb.models import load_causal_lm, load_tokenizer, pad_id_of
from rpb.prior.artifact import prior_kind_of
from rpb.prior.checks import load_prior
from rpb.teacher.lineage import lineage_problems
from rpb.train.checkpoints import CompleteMarker, resolve_resume, run_record, trim_log
from rpb.train.config import RunConfig
from rpb.train.lora import LoraSection
from rpb.train.trainer import AnchorTrainer, AnchorTrainerMixin, JsonlLog

__all__ = [
    "AnchorTrainer",
    "AnchorTrainerMixin",
    "JsonlLog",
    "PreparedRun",
    "attach_anchor",
    "prepare_run",
    "run_training",
]

logger = logging.getLogger(__name__)


@dataclass
class PreparedRun:
    model: torch.nn.Module
    tokenizer: object
    dataset: ExampleDataset
    collator: AnchorCollator
    handle: AnchorHandle
    max_seq_len: int
    info: dict
    expert_mask: ExpertMask | None = None


def attach_anchor(
    model: torch.nn.Module,
    tokenizer,
    data: LabelledData,
    anchor_cfg: AnchorConfig,
    artifact=None,
    *,
    model_id: str,
    prior_path: str = "prior",
    tokenizer_id: str | None = None,
    max_seq_len: int | None = None,
    adapter: str | None = None,
    batch_size: int = 8,
    progress: bool = True,
    lora: LoraSection | None = None,
    seed: int = 42,
    experts_implementation: str | None = None,
) -> tuple[AnchorHandle, dict]:
    """Check the prior (``artifact``, may be None for methods without one) against this model,
    tokenizer and labelled data file, wrap the model with LoRA if ``lora`` says so, then install the
    anchor (on the wrapped model: ``handle.model``); returns the handle and what the run records
    (method, rows, the shuffled controls' permutations). ``rpb train`` and the TRL integration both
    start here, so they refuse the same mismatches with the same errors. routing-kd and output-kd get their base
    (``handle.teacher``, ``rpb.teacher``): the route file, checked against this data and model before the LoRA
    wrap, or the online base after it (adapters off under LoRA; else a frozen copy of ``model_id`` with the
    training model's ``experts_implementation``)."""
    method = get_method(anchor_cfg.method)
    if method.needs_prior and artifact is None:
        raise ArgumentError(f"anchor.method={method.name} needs a prior (`rpb collect`); none was given")
    meta = artifact.metadata if artifact is not None else {}
    max_seq_len = max_seq_len or meta.get("max_seq_len")
    facts = get_adapter(adapter or model.config.model_type)
    layers = find_moe_layers(model, facts)
    if artifact is not None:
        run = RunFacts(
            data_sha256=data.sha256,
            num_rows=data.num_rows,
            model=model_id,
            routers_sha256=routers_sha256(layers, facts),
            tokenizer=tokenizer_id or model_id,
            chat_template_sha256=ChatTemplate(tokenizer).sha256,
            chat_template_kwargs=data.template_settings.get("chat_template_kwargs", {}),
            top_k=int(getattr(model.config, facts.top_k_config)),
            max_seq_len=max_seq_len,
            moe_layers=[m.layer_index for m in layers],
            num_experts=int(layers[0].router.weight.shape[0]),
            router_transform=anchor_cfg.router_transform,
        )
        verify_prior(meta, run, prior_path)
    # a copy: the caller's configuration stays as given (it is recorded in rpb_run.json)
    transform = run_transform(anchor_cfg.router_transform, meta.get("router_transform"), facts.score_function)
    anchor_cfg = dataclasses.replace(anchor_cfg, router_transform=transform)

    info: dict = {
        "method": method.name,
        "rows": data.num_rows,
        "max_seq_len": max_seq_len,
        "data_sha256": data.sha256,
        "router_transform": anchor_cfg.router_transform,
        # probability (eq. 2), or an engine's selection frequency (rpb collect --from-routes)
        **({"prior_kind": prior_kind_of(meta)} if meta else {}),
        **data.template_settings,
        "reasoning": data.reasoning,
        "truncated_rows": data.truncated_rows,
    }
    sigma_LE = None
    if method.shuffle is not None:
        labels_LE = None
        if method.needs_communities:
            # the base's communities over the training data: of expert transitions for the transition controls,
            # of co-activation for the others
            where = (model, layers, data.examples, anchor_cfg.shuffle_seed, anchor_cfg.community_resolution)
            if method.shuffle == "within-transition":
                comm = base_transition_communities(*where, batch_size, pad_id_of(tokenizer))
            else:
                comm = base_communities(*where, batch_size, pad_id_of(tokenizer), progress)
            labels_LE = comm.labels_LE
            info["base_communities"] = {"labels": labels_LE.tolist(), "modularity": comm.modularity_L}
        num_experts = int(layers[0].router.weight.shape[0])
        sigma_LE = layer_permutations(labels_LE, num_experts, anchor_cfg.shuffle_seed, method.shuffle, len(layers))
        info["shuffle"] = {"mode": method.shuffle, "seed": anchor_cfg.shuffle_seed, "sigma": sigma_LE.tolist()}
    stored = None
    if method.teacher is not None and (lineage := lineage_problems(model_id, anchor_cfg.trained_base)):
        raise ArgumentError("; ".join(lineage))
    if method.teacher is not None and anchor_cfg.base == "routes":
        from rpb.teacher import load_stored_routes

        stored = load_stored_routes(
            anchor_cfg.routes,
            data,
            routers_sha256=routers_sha256(layers, facts),
            moe_layers=[m.layer_index for m in layers],
            num_layers=int(model.config.get_text_config().num_hidden_layers),
            top_k=int(getattr(model.config, facts.top_k_config)),
            num_experts=int(layers[0].router.weight.shape[0]),
            transform=anchor_cfg.router_transform,
            routes_loss=anchor_cfg.routes_loss,
        )
    if lora is not None and lora.enabled:
        from rpb.train.lora import apply_lora

        set_seed(seed)  # LoRA's A matrices are drawn from the global generator: the run's seed fixes them
        model = apply_lora(model, lora, facts)  # before the anchor: PEFT replaces or copies the routers
        info["lora"] = dataclasses.asdict(lora)
    handle = install_anchor(
        model,
        anchor_cfg,
        prior=artifact.prior_qa if artifact is not None else None,
        sigma_LE=sigma_LE,
        adapter=adapter,
    )
    if method.teacher is not None:
        if stored is None:
            from rpb.teacher import online_base

            stored = online_base(
                handle.model,
                facts,
                model_id=model_id,
                dtype=anchor_cfg.base_dtype,
                outputs=method.teacher == "output",
                experts_implementation=experts_implementation,
            )
        handle.teacher = stored
        info["base"] = stored.describe()
    return handle, info


def prepare_run(cfg: RunConfig, progress: bool = True) -> PreparedRun:
    """Load everything, check the prior against it, and install the anchor."""
    tokenizer = load_tokenizer(cfg.tokenizer or cfg.model, cfg.trust_remote_code)
    artifact = load_prior(cfg.prior) if cfg.prior else None  # memory-mapped: a node's ranks share one copy
    meta = artifact.metadata if artifact else {}
    max_seq_len = cfg.train.max_seq_len or meta["max_seq_len"]
    # every bad row, before any compute; the day a clock-reading template sees is the prior's
    data = load_labelled(
        cfg.data_jsonl, tokenizer, max_seq_len, cfg.data.chat_template_kwargs, meta.get("chat_template_date")
    )
    note_reasoning(data.reasoning, data.template_settings)
    note_truncated(data.truncated_rows, data.num_rows, max_seq_len)
    model = load_causal_lm(cfg.model, cfg.train.dtype, cfg.train.experts_implementation)
    if cfg.train.experts_implementation == SORTED_EXPERTS and not (
        cfg.data.packing or cfg.train.gradient_checkpointing
    ):
        # padding gets no expert work (packed batches carry no attention mask; a checkpointed block's
        # recomputation runs outside the model's forward, where the mask is not set, so both compute every token)
        TokenMask(model)
    expert_mask = None
    if cfg.train.only_experts:  # before the anchor: it checks which routers can still train
        from rpb.experts import read_choice, train_only_experts

        facts = get_adapter(cfg.adapter or model.config.model_type)
        expert_mask = train_only_experts(model, read_choice(cfg.train.only_experts), facts)
    handle, info = attach_anchor(
        model,
        tokenizer,
        data,
        cfg.anchor,
        artifact,
        model_id=cfg.model,
        prior_path=cfg.prior,
        tokenizer_id=cfg.tokenizer,
        max_seq_len=max_seq_len,
        adapter=cfg.adapter,
        batch_size=cfg.train.batch_size,
        progress=progress,
        lora=cfg.lora,
        seed=cfg.train.seed,
        experts_implementation=cfg.train.experts_implementation,
    )
    if cfg.lora.enabled and cfg.train.gradient_checkpointing:
        handle.model.enable_input_require_grads()  # frozen embeddings: checkpointed blocks need a grad input
    examples = data.examples
    if cfg.data.mix:  # after the anchor: what it checks is the training file (a prior-reading method refuses a mix)
        from rpb.data.mix import mix, mix_sources

        extras = [
            (s, load_labelled(s.path, tokenizer, max_seq_len, cfg.data.chat_template_kwargs))
            for s in mix_sources(cfg.data.mix)
        ]
        mixed = mix(data, extras, cfg.data.seed)
        examples, info["data_mix"] = mixed.examples, mixed.record
    dataset = ExampleDataset(examples, cfg.train.loss_on)
    collator = AnchorCollator(pad_id=pad_id_of(tokenizer), pack=cfg.data.packing, max_len=max_seq_len)
    return PreparedRun(handle.model, tokenizer, dataset, collator, handle, max_seq_len, info, expert_mask)


#: deterministic mode's NaN fill of every new uninitialized tensor (torch's default: on). It changes no result
#: (no kernel reads memory it has not written) and cost a quarter of a toy-world step on CPU (first touch of
#: fresh pages, docs/performance.md); off here. benchmarks/toyworld_speed.py turns it on for the old path
FILL_UNINITIALIZED_MEMORY = False


@contextlib.contextmanager
def deterministic_algorithms(enabled: bool = True):
    """Deterministic kernels for the block; the caller's setting comes back after. Even on CPU: the experts'
    token-gather backward adds in thread order (``index_put_(accumulate=True)``), so one step run twice differs
    by ~1e-7 and a 500-step cell by a point; the deterministic kernel sorts first (on 2 cores: no slower)."""
    if not enabled:
        yield
        return
    before = torch.are_deterministic_algorithms_enabled()
    warn_only = torch.is_deterministic_algorithms_warn_only_enabled()
    # cuBLAS reads it when it first starts; without it, deterministic GEMMs raise on CUDA >= 10.2
    os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
    fill = torch.utils.deterministic.fill_uninitialized_memory
    torch.use_deterministic_algorithms(True)
    torch.utils.deterministic.fill_uninitialized_memory = FILL_UNINITIALIZED_MEMORY
    try:
        yield
    finally:
        torch.use_deterministic_algorithms(before, warn_only=warn_only)
        torch.utils.deterministic.fill_uninitialized_memory = fill


def training_arguments(cfg: RunConfig, progress: bool = True) -> TrainingArguments:
    t = cfg.train
    on_cpu = not torch.cuda.is_available()
    # transformers 5.x renamed gradient_checkpointing* to activation_checkpointing*
    names = {f.name for f in dataclasses.fields(TrainingArguments)}
    ckpt = "activation_checkpointing" if "activation_checkpointing" in names else "gradient_checkpointing"
    checkpointing = {
        ckpt: t.gradient_checkpointing,
        # reentrant checkpointing runs the first forward without grad, which would cut the
        # anchors' loss terms off from the graph
        f"{ckpt}_kwargs": {"use_reentrant": False},
    }
    return TrainingArguments(
        output_dir=cfg.output_dir,
        max_steps=t.max_steps,
        per_device_train_batch_size=t.batch_size,
        gradient_accumulation_steps=t.grad_accum,
        learning_rate=t.lr,
        weight_decay=t.weight_decay,
        warmup_steps=t.warmup_steps,
        lr_scheduler_type=t.lr_scheduler,
        seed=t.seed,
        data_seed=cfg.data.seed,
        logging_steps=t.log_every,
        report_to=t.report_to,
        save_strategy="steps" if t.save_every else "no",
        save_steps=t.save_every or 500,
        remove_unused_columns=False,
        **checkpointing,
        fsdp=t.fsdp,
        fsdp_config=t.fsdp_config,
        use_cpu=on_cpu,
        ddp_backend="gloo" if on_cpu and int(os.environ.get("WORLD_SIZE", "1")) > 1 else None,
        dataloader_num_workers=0,
        disable_tqdm=not progress,
    )


def run_training(cfg: RunConfig, progress: bool = True, callbacks: list[TrainerCallback] | None = None) -> Path:
    """The ``rpb train`` job; returns the directory of the saved checkpoint.

    ``callbacks`` given: they replace the Trainer's own progress bar and console log lines (the
    JSONL log is always written), for callers that show their own progress.
    """
    # a process group that exists now is the caller's; one the Trainer starts (torchrun) is ours to end
    owns_group = not (torch.distributed.is_available() and torch.distributed.is_initialized())
    prepared = prepare_run(cfg, progress and callbacks is None)
    out = Path(cfg.output_dir)
    out.mkdir(parents=True, exist_ok=True)
    # the base's routers as loaded, before any training or resumed weights touch them
    record = run_record(
        cfg,
        base_routers_sha256=routers_sha256([lay.moe for lay in prepared.handle.layers], prepared.handle.facts),
        data_sha256=prepared.info["data_sha256"],
        prior_sha256=file_sha256(cfg.prior) if cfg.prior else None,
        data_mix=prepared.info.get("data_mix"),
    )
    markers = [CompleteMarker(record)] if cfg.train.save_every else []
    trainer = AnchorTrainer(
        model=prepared.model,
        args=training_arguments(cfg, progress and callbacks is None),
        train_dataset=prepared.dataset,
        data_collator=prepared.collator,
        anchor=prepared.handle,
        expert_mask=prepared.expert_mask,
        monitor=cfg.monitor,
        # the marker before the caller's callbacks: a checkpoint is complete before anyone else hears of it
        callbacks=[JsonlLog(out / "log.jsonl"), *markers, *(callbacks or [])],
    )
    if callbacks is not None:
        trainer.remove_callback(PrinterCallback)
    resume = resolve_resume(out, cfg.train.resume_from_checkpoint, record)
    if trainer.is_world_process_zero():
        if resume:
            trim_log(out / "log.jsonl", resume)
        from rpb.train.start import check_displacement, note_base

        check_displacement(cfg, prepared, out / "log.jsonl")
        note_base(prepared.info.get("base"), out / "log.jsonl")
    try:
        with deterministic_algorithms(cfg.train.deterministic):
            trainer.train(resume_from_checkpoint=resume)
    finally:
        prepared.handle.remove()
    if cfg.train.save and cfg.lora.enabled:
        if trainer.is_world_process_zero():
            from rpb.train.lora import save_lora

            save_lora(trainer.model, out, cfg.lora.merge)
            prepared.tokenizer.save_pretrained(out)
    elif cfg.train.save:
        trainer.save_model(str(out))
        if trainer.is_world_process_zero():
            prepared.tokenizer.save_pretrained(out)
    if trainer.is_world_process_zero():
        # the optimizer steps the saved weights have taken, and where a resumed run picked them up
        steps = {"global_step": trainer.state.global_step, "resumed_from": resume}
        record = {"config": asdict(cfg), **prepared.info, **steps}
        write_text_atomic(out / "rpb_run.json", json.dumps(record, indent=1, default=str))
    dist = torch.distributed
    group = dist.group.WORLD if dist.is_available() and dist.is_initialized() else None
    if group is not None:
        dist.barrier()
    del trainer, prepared  # before the group: DDP's Reducer freeing a gloo group last can hang (docs/training.md)
    gc.collect()
    if group is not None and owns_group:
        dist.destroy_process_group()
    return out
