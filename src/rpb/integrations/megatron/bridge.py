"""Megatron-Bridge glue for ``examples/moonlight``: the recipe, the data, the anchored forward step.

Imports megatron.bridge only inside the functions that need it; the pure parts (the micro-batch
builder and the context-setting iterator) are tested on CPU.

Data. Bridge's stock SFT dataset tokenizes prompt and answer separately, truncates the
prompt, and feeds ``input_ids[:-1]``: its tokens would not be the collector's, and its last
position would never be routed. ``RPBSFTDataset`` keeps what Bridge's ``GPTSFTDataset``
does for the file -- the memory-mapped JSONL with its index files, the number of samples --
and takes the row order from ``row_order`` (seeded by ``data.seed``, the same on every
Bridge line; v0.3.1's own sample mapping ignores the seed) and each row's tokens and Q/A
spans from ``rpb.data``, the labelling the collector used. Every position of the truncated sequence is fed (the prior's
routed-position rule); the last one has no next token, so it carries no loss, and the
loss is the one of the stock shifted dataset.

Forward step. ``AnchoredForwardStep`` installs the anchor at its first call (after Bridge
has built the model and loaded the base checkpoint, before the first optimizer step, so
the routers' fingerprint is the base model's), checks the prior, and wraps the data
iterator so that each micro-batch sets the anchor's (sample, span) context before Bridge's
own ``forward_step`` runs it. With pipeline parallelism 1 each micro-batch's backward runs
before the next micro-batch is read, so the context is in place for recomputation.

Loss. For the loss-based anchors (lbl, router-l2, kl-to-base, logit-l2) the forward step wraps
Bridge's loss function in ``anchored_loss``, which adds the anchor's term for the micro-batch
that just ran forward (``handle.loss()``) and reports it as ``rpb anchor loss``. router-freeze
freezes the routers with a pre-wrap hook (``build_container``), before DDP and the optimizer
take the trainable parameters.
"""

from __future__ import annotations

import dataclasses
import functools
import logging
from dataclasses import dataclass

import torch

from rpb.data.batches import answer_mask

logger = logging.getLogger(__name__)

SAMPLE_KEY = "rpb_sample_index"
SPAN_KEY = "rpb_span"
#: the key of the anchor's loss term in the loss function's report (logged beside "lm loss")
ANCHOR_LOSS_KEY = "rpb anchor loss"


def micro_batch(
    features: list[dict], pad_id: int, seq_length: int, pad_to_multiple: int = 16, loss_on: str = "answer"
) -> dict[str, torch.Tensor]:
    """Bridge's GPT batch keys for rows ``{input_ids, span_ids, sample_index}``, plus the rpb keys.

    ``tokens[t] = ids[t]`` for every position of the row (all routed); ``labels[t] = ids[t + 1]``
    and ``loss_mask[t]`` says whether ``ids[t + 1]`` is a target (assistant content and the
    turn end for ``loss_on="answer"``, every token for ``"all"``); the last position and the
    padding have no target. Rows are right-padded to a multiple of ``pad_to_multiple`` (at
    most ``seq_length``); padding gets sample -1 and span -1.
    """
    longest = max(len(f["input_ids"]) for f in features)
    if longest > seq_length:
        raise ValueError(f"a row of {longest} tokens does not fit seq_length={seq_length}")
    width = min(-(-longest // pad_to_multiple) * pad_to_multiple, seq_length)
    B = len(features)
    out = {
        "tokens": torch.full((B, width), pad_id, dtype=torch.long),
        "labels": torch.full((B, width), pad_id, dtype=torch.long),
        "loss_mask": torch.zeros((B, width), dtype=torch.float32),
        "position_ids": torch.arange(width).repeat(B, 1),
        SAMPLE_KEY: torch.full((B, width), -1, dtype=torch.long),
        SPAN_KEY: torch.full((B, width), -1, dtype=torch.long),
    }
    for b, f in enumerate(features):
        ids, spans = torch.tensor(f["input_ids"]), torch.tensor(f["span_ids"])
        n = len(ids)
        target = torch.tensor(answer_mask(f["span_ids"])) if loss_on == "answer" else torch.ones(n, dtype=torch.bool)
        out["tokens"][b, :n] = ids
        out["labels"][b, : n - 1] = ids[1:]
        out["loss_mask"][b, : n - 1] = target[1:].float()
        out[SAMPLE_KEY][b, :n] = int(f["sample_index"])
        out[SPAN_KEY][b, :n] = spans
    return out


#: module paths of Bridge's SFT dataset, newest line first (0.6.x moved it to gpt_sft; 0.3.1 has sft)
SFT_DATASET_MODULES = ("megatron.bridge.data.datasets.gpt_sft", "megatron.bridge.data.datasets.sft")


def sft_dataset_class():
    """Bridge's ``GPTSFTDataset``, found by where the installed line keeps it."""
    import importlib

    tried = []
    for name in SFT_DATASET_MODULES:
        try:
            return importlib.import_module(name).GPTSFTDataset
        except (ImportError, AttributeError) as e:
            tried.append(f"{name} ({type(e).__name__}: {e})")
    raise ImportError("no GPTSFTDataset in the installed megatron-bridge; tried " + "; ".join(tried))


def row_order(num_rows: int, seed: int, epoch: int) -> torch.Tensor:
    """The data file's rows in the order epoch ``epoch`` of a run with ``data.seed=seed`` reads them.

    rpb's own seeded shuffle, the same on every Bridge line: Bridge v0.3.1's online sample mapping
    keeps its own seed, so ``data.seed`` would not change the order there."""
    gen = torch.Generator().manual_seed(seed * 1_000_003 + epoch)
    return torch.randperm(num_rows, generator=gen)


def sample_row(idx: int, num_rows: int, seed: int) -> int:
    """The row behind global sample ``idx``: sample ``idx`` is position ``idx % N`` of epoch ``idx // N``
    (a negative id, which pads a global batch in evaluation only, reads as its absolute value)."""
    epoch, pos = divmod(abs(int(idx)), num_rows)
    return int(row_order(num_rows, seed, epoch)[pos])


class ContextIterator:
    """Wraps Bridge's data iterator: each batch drawn sets the anchor's context, minus the rpb keys."""

    def __init__(self, iterator, handle):
        self.iterator, self.handle = iterator, handle

    def __iter__(self):
        return self

    def __next__(self) -> dict:
        batch = dict(next(self.iterator))
        sample_BS, span_BS = batch.pop(SAMPLE_KEY), batch.pop(SPAN_KEY)
        if self.handle is not None:
            self.handle.set_micro_batch(sample_BS, span_BS)
        return batch


def anchored_loss(loss_fn, handle, output_tensor):
    """Bridge's loss function for one micro-batch plus the anchor's term; ``(loss, num_tokens, report)``.

    ``loss_fn(output_tensor)`` returns Bridge's ``(sum of the token losses, num_tokens, report)``.
    Megatron then divides the loss by ``num_tokens`` and the number of micro-batches (or, with
    ``calculate_per_token_loss``, the gradients by the tokens of the whole batch), so the term,
    a per-micro-batch mean like the HF path's, enters as ``term * num_tokens``: it is added
    once per micro-batch, as Megatron adds its own auxiliary losses. The report gets the whole
    term (all TP ranks' shares) as ``[value, 1]``, which Bridge averages over micro-batches and
    data-parallel ranks, and the routing figures (``handle.report()``: ``moe/layer_{i}/...``,
    ``moe/mean/...`` as ``[numerator, denominator]``), which Bridge reduces the same way.
    """
    loss, num_tokens, report = loss_fn(output_tensor)
    report = {**report, **{k: v.to(loss.device) for k, v in handle.report().items()}}
    if handle.method.loss is None:
        return loss, num_tokens, report
    term = handle.loss()
    # a micro-batch without targets still carries its routers' term (Megatron clamps the count too)
    loss = loss + term * num_tokens.clamp(min=1).to(term.device)
    value = term.detach().float().reshape(1) * handle.loss_shares
    return loss, num_tokens, {**report, ANCHOR_LOSS_KEY: torch.cat([value, torch.ones_like(value)])}


# ---- everything below imports megatron.bridge --------------------------------------------------
def build_container(cfg, model=None):
    """The Bridge ``ConfigContainer``: the Moonlight SFT recipe with the run's (the paper's) settings.

    ``model``: a model provider to run instead of the recipe's (``examples/moonlight/smoke.py``: a
    scaled-down Moonlight from ``AutoBridge.to_megatron_provider``); the run's settings apply to it alike."""
    import importlib

    recipe = getattr(importlib.import_module("megatron.bridge.recipes.moonlight"), cfg.model.recipe)
    c = recipe()
    if model is not None:
        c.model = model
    p, t, m, o, s = cfg.parallel, cfg.train, cfg.moe, cfg.optimizer, cfg.scheduler
    model = c.model
    model.tensor_model_parallel_size = p.tensor
    model.pipeline_model_parallel_size = p.pipeline
    model.context_parallel_size = p.context
    model.expert_model_parallel_size = p.expert
    model.expert_tensor_parallel_size = p.expert_tensor
    model.sequence_parallel = p.sequence_parallel
    model.seq_length = t.seq_length
    model.recompute_granularity = t.recompute_granularity
    # routing as the paper ran it: dropless top-k, no auxiliary loss, no MTP, the expert bias frozen
    model.moe_router_score_function = m.score_function
    model.moe_router_topk = m.topk
    model.num_moe_experts = m.num_experts
    model.moe_expert_capacity_factor = None
    model.moe_aux_loss_coeff = m.aux_loss_coeff
    if m.aux_loss_coeff == 0:
        model.moe_router_load_balancing_type = "none"
    model.mtp_num_layers = m.mtp_num_layers or None
    model.moe_router_enable_expert_bias = m.expert_bias == "frozen"
    model.moe_router_bias_update_rate = 0.0
    model.moe_router_fusion = m.router_fusion
    if cfg.anchor.method == "router-freeze":
        from rpb.integrations.megatron.install import freeze_router_parameters

        # before DDP and the optimizer take the trainable parameters (install checks it)
        model.register_pre_wrap_hook(freeze_router_parameters)

    c.train.train_iters = t.steps
    c.train.global_batch_size = t.global_batch_size
    c.train.micro_batch_size = t.micro_batch_size
    c.train.eval_iters = 0
    c.rng.seed = t.seed
    c.checkpoint.pretrained_checkpoint = cfg.model.pretrained_checkpoint
    c.checkpoint.save = f"{t.output_dir}/checkpoints"
    c.checkpoint.load = f"{t.output_dir}/checkpoints"
    c.checkpoint.save_interval = t.save_interval
    c.logger.log_interval = t.log_interval
    c.logger.tensorboard_dir = f"{t.output_dir}/tensorboard"  # the routing figures land there too
    c.tokenizer.tokenizer_model = cfg.model.tokenizer or cfg.model.hf_id
    c.tokenizer.hf_tokenizer_kwargs = {"trust_remote_code": cfg.model.trust_remote_code}
    # the same run on every line: the schedule, dispatcher and optimizer precision set here, not by the recipe
    from rpb.integrations.megatron.guard import check_container, enforce_contract

    enforce_contract(c)

    # not stated by the paper: Megatron-Bridge's Moonlight recipe values, as the config records them
    for key in ("lr", "min_lr", "adam_beta1", "adam_beta2", "adam_eps", "weight_decay", "clip_grad"):
        setattr(c.optimizer, key, getattr(o, key))
    for key in (
        "lr_decay_style",
        "lr_warmup_iters",
        "lr_decay_iters",
        "lr_warmup_init",
        "start_weight_decay",
        "end_weight_decay",
        "weight_decay_incr_style",
    ):
        setattr(c.scheduler, key, getattr(s, key))
    check_container(c, f"{cfg.model.recipe} with the run's settings", method=cfg.anchor.method)
    return c


def rpb_sft_dataset(cfg, examples: list, pad_id: int, tokenizer, max_num_samples: int):
    """Bridge's ``GPTSFTDataset`` on the data file (its memory-mapped index, its length) reading rpb's rows:
    the training split ``dataset_provider`` builds. Imports only Bridge's SFT dataset module."""

    class RPBSFTDataset(sft_dataset_class()):
        """GPTSFTDataset's file index and length; rpb's row order (``row_order``, seeded by data.seed), tokens
        and spans for each sample."""

        def __getitem__(self, idx):
            e = examples[sample_row(idx, len(examples), cfg.data.seed)]
            return {"input_ids": e.input_ids, "span_ids": e.span_ids, "sample_index": e.index}

        def collate_fn(self, batch):
            return micro_batch(batch, pad_id, cfg.train.seq_length, cfg.data.pad_to_multiple, cfg.train.loss_on)

    _importable(RPBSFTDataset)
    train = RPBSFTDataset(
        file_path=str(cfg.data_file),
        tokenizer=tokenizer,
        max_seq_length=cfg.train.seq_length,
        seed=cfg.data.seed,
        max_num_samples=max_num_samples,
        prompt_template="{input} {output}",
        label_key="output",
        truncation_field="input",
        memmap_workers=cfg.data.memmap_workers,
    )
    if len(train.indexed_dataset) != len(examples):
        raise ValueError(
            f"{cfg.data_file}: Bridge's index has {len(train.indexed_dataset)} rows, rpb read "
            f"{len(examples)}; rebuild the index files (docs/megatron.md)"
        )
    return train


def _importable(cls) -> None:
    # Bridge writes the dataset config into every checkpoint (run_config.yaml) under its class's
    # import path: give the class a resolvable one
    cls.__qualname__ = cls.__name__
    globals()[cls.__name__] = cls


def dataset_provider(cfg, examples: list, pad_id: int):
    """A Bridge ``DatasetProvider`` whose training split is ``rpb_sft_dataset`` (no validation or test split)."""
    from megatron.bridge.training.config import DatasetProvider

    @dataclass(kw_only=True)
    class RPBDatasetProvider(DatasetProvider):
        seq_length: int

        def build_datasets(self, context):
            return rpb_sft_dataset(cfg, examples, pad_id, context.tokenizer, context.train_samples), None, None

    _importable(RPBDatasetProvider)
    # rows are pre-tokenized: loader workers would gain nothing
    return RPBDatasetProvider(seq_length=cfg.train.seq_length, dataloader_type="batch", num_workers=0)


class AnchoredForwardStep:
    """Bridge's ``forward_step`` with the anchor installed (at the first call) and fed per micro-batch."""

    def __init__(self, cfg, prepared):
        self.cfg, self.prepared, self.handle = cfg, prepared, None

    def __call__(self, state, data_iterator, model, return_schedule_plan: bool = False):
        if return_schedule_plan:
            # Bridge asks for one under EP overlap's combined 1F1B schedule (build_container turns it off):
            # the loss would leave without the anchor's term, and micro-batches interleave
            raise RuntimeError(
                "rpb: Bridge asked the anchored forward step for a schedule plan (EP communication overlap, "
                "combined 1F1B); the anchor needs each micro-batch's forward and backward together and its loss "
                "wrapped: set comm_overlap.overlap_moe_expert_parallel_comm=False (docs/megatron.md)"
            )
        from megatron.bridge.training.gpt_step import forward_step

        if self.handle is None:
            self.handle = self.prepared.install(model, first_step=state.train_state.step == 0)
        output, loss_fn = forward_step(state, ContextIterator(data_iterator, self.handle), model)
        # Megatron calls the loss function right after this forward, while its context is set (every
        # method: the routing figures ride along in the report)
        return output, functools.partial(anchored_loss, loss_fn, self.handle)


@dataclass
class PreparedData:
    """What the anchor needs besides the model: the labelled rows, the prior and the run's facts."""

    cfg: object
    data: object  # rpb.data.LabelledData
    tokenizer: object
    artifact: object | None

    def install(self, model, first_step: bool):
        from rpb.anchors.methods import get_method
        from rpb.anchors.transform import run_transform
        from rpb.integrations.megatron.install import find_topk_routers, install_megatron_anchor
        from rpb.integrations.megatron.layout import ROUTED_ALL_POSITIONS
        from rpb.integrations.megatron.verify import megatron_run_facts, verify_megatron_prior

        cfg, meta = self.cfg, self.artifact.metadata if self.artifact is not None else None
        method = get_method(cfg.anchor.method)
        if not first_step and method.needs_base_router:
            # the base copies are taken at install: on a resumed run they would be the trained routers
            raise RuntimeError(
                f"anchor.method {cfg.anchor.method!r} compares the routers with the base model's, copied when the "
                "anchor is installed; a resumed run would copy the trained routers instead: start from the base "
                "checkpoint (no checkpoint.load of this run)"
            )
        sigma_LE = None
        if meta is not None:
            from rpb.data import ChatTemplate

            routers = find_topk_routers(model)
            run = megatron_run_facts(
                routers,
                data_sha256=self.data.sha256,
                num_rows=self.data.num_rows,
                model=cfg.model.hf_id,
                tokenizer=cfg.model.tokenizer or cfg.model.hf_id,
                chat_template_sha256=ChatTemplate(self.tokenizer).sha256,
                max_seq_len=meta["max_seq_len"],
                routed_positions=ROUTED_ALL_POSITIONS,
                router_transform=cfg.anchor.router_transform,
                chat_template_kwargs=self.data.template_settings.get("chat_template_kwargs"),
            )
            if not first_step:
                # resumed: the routers have trained, so their fingerprint is no longer the base model's
                run = dataclasses.replace(run, routers_sha256=meta.get("routers_sha256"))
                logger.warning("rpb: resumed run, router fingerprint not checked against the prior")
            rows = [(e.index, e.span_ids) for e in self.data.examples]
            note = verify_megatron_prior(meta, run, rows, cfg.prior)
            if note:
                logger.warning("rpb: %s", note)
            if method.shuffle == "global":  # the within-* shuffles need base communities (refused by the config)
                from rpb.anchors.controls import layer_permutations

                E, L = self.artifact.prior_qa.shape[-1], self.artifact.prior_qa.shape[2]
                sigma_LE = layer_permutations(None, E, cfg.anchor.shuffle_seed, "global", L)
        prior = self.artifact.prior_qa if self.artifact is not None else None
        # kl-to-base compares distributions under the run's transform, resolved as rpb train does
        score_function = next((r.module.score_function for r in find_topk_routers(model)), "softmax")
        transform = run_transform(cfg.anchor.router_transform, (meta or {}).get("router_transform"), score_function)
        anchor = dataclasses.replace(cfg.anchor, router_transform=transform)
        handle = install_megatron_anchor(model, anchor, prior=prior, sigma_LE=sigma_LE)
        for note in handle.notes:
            logger.warning("rpb: %s", note)
        return handle


def prepare_data(cfg) -> PreparedData:
    """Tokenize and label the data file exactly as the collector did (every bad row reported before launch)."""
    from rpb.data import load_labelled
    from rpb.models import load_tokenizer
    from rpb.prior.checks import load_prior

    artifact = load_prior(cfg.prior) if cfg.prior else None
    max_seq_len = artifact.metadata["max_seq_len"] if artifact is not None else cfg.train.seq_length
    tokenizer = load_tokenizer(cfg.model.tokenizer or cfg.model.hf_id, cfg.model.trust_remote_code)
    # rendered as the prior was: its template keyword arguments, and the day a clock-reading template saw
    settings = artifact.metadata if artifact is not None else {}
    data = load_labelled(
        cfg.data_file, tokenizer, max_seq_len, settings.get("chat_template_kwargs"), settings.get("chat_template_date")
    )
    return PreparedData(cfg, data, tokenizer, artifact)


def run_training(cfg) -> None:
    """The whole Bridge job on this rank (launched by torchrun on every GPU)."""
    from megatron.bridge.training.finetune import finetune

    prepared = prepare_data(cfg)
    container = build_container(cfg)
    pad_id = prepared.tokenizer.eos_token_id if prepared.tokenizer.eos_token_id is not None else 0
    container.dataset = dataset_provider(cfg, prepared.data.examples, pad_id)
    step = AnchoredForwardStep(cfg, prepared)
    from rpb.integrations.megatron.guard import check_container

    check_container(container, "the container finetune receives", method=cfg.anchor.method)
    try:
        finetune(container, step)
    finally:
        if step.handle is not None:
            step.handle.remove()
