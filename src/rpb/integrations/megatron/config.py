"""The Megatron-Bridge run configuration (``examples/moonlight/config.yaml``), validated without GPUs.

Nothing here imports megatron: ``rpb megatron-check CONFIG`` reads the YAML, applies dotted
overrides, and reports every problem at once (``ConfigError``), plus the places where the
run departs from the paper's setup (notes, not errors). With ``check_files`` it also opens
the prior's metadata and the data file and checks them against the run.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Literal

from rpb.anchors.config import AnchorConfig
from rpb.anchors.methods import LBL, METHODS
from rpb.data.batches import LossOn
from rpb.errors import ConfigError
from rpb.train.config import build_section, read_tree


@dataclass
class ModelSection:
    #: HF id or directory of the base model: tokenizer, chat template, and the id the prior records
    hf_id: str = "moonshotai/Moonlight-16B-A3B"
    tokenizer: str | None = None
    trust_remote_code: bool = True
    #: the base checkpoint converted to Megatron format with Megatron-Bridge's converter
    pretrained_checkpoint: str = ""
    #: Megatron-Bridge recipe function the run starts from (module megatron.bridge.recipes.moonlight)
    recipe: str = "moonlight_16b_sft_config"


@dataclass
class ParallelSection:
    nodes: int = 16
    gpus_per_node: int = 8
    tensor: int = 2
    pipeline: int = 1
    context: int = 1
    expert: int = 8
    expert_tensor: int = 1
    sequence_parallel: bool = True


@dataclass
class TrainSection:
    steps: int = 782
    global_batch_size: int = 128
    micro_batch_size: int = 1
    seq_length: int = 8192
    seed: int = 42
    output_dir: str = ""
    save_interval: int = 782
    log_interval: int = 1
    loss_on: LossOn = "answer"
    #: Megatron activation recomputation: None, "selective" or "full" (the anchor survives either)
    recompute_granularity: Literal["selective", "full"] | None = "selective"


@dataclass
class DataSection:
    #: directory holding ``file`` and, built before launch, its ``.idx.npy`` / ``.idx.info`` index files
    root: str = ""
    file: str = "training.jsonl"
    seed: int = 42
    packed: bool = False
    #: pad each micro-batch to a multiple of this (of the TP size under sequence parallelism)
    pad_to_multiple: int = 16
    memmap_workers: int = 1


@dataclass
class MoESection:
    score_function: Literal["sigmoid", "softmax"] = "sigmoid"
    topk: int = 6
    num_experts: int = 64
    #: no capacity factor: every token reaches its experts
    dropless: bool = True
    aux_loss_coeff: float = 0.0
    mtp_num_layers: int = 0
    #: "frozen": the pretrained expert bias enters selection, its update rate is 0; "none": no expert bias
    expert_bias: Literal["frozen", "none"] = "frozen"
    router_fusion: bool = False


@dataclass
class OptimizerSection:
    lr: float = 5e-6
    min_lr: float = 0.0
    adam_beta1: float = 0.9
    adam_beta2: float = 0.98
    adam_eps: float = 1e-5
    weight_decay: float = 0.1
    clip_grad: float = 1.0


@dataclass
class SchedulerSection:
    lr_decay_style: Literal["cosine", "linear", "constant", "WSD", "inverse-square-root"] = "cosine"
    lr_warmup_iters: int = 50
    lr_decay_iters: int = 1000
    lr_warmup_init: float = 0.0
    #: Bridge's scheduler overrides the optimizer's weight decay with these (effective value)
    start_weight_decay: float = 0.033
    end_weight_decay: float = 0.033
    weight_decay_incr_style: Literal["constant", "linear", "cosine"] = "constant"


@dataclass
class MegatronRunConfig:
    """The run; after ``load_megatron_config`` also ``notes``: where it departs from the paper's setup."""

    prior: str = ""
    model: ModelSection = field(default_factory=ModelSection)
    parallel: ParallelSection = field(default_factory=ParallelSection)
    train: TrainSection = field(default_factory=TrainSection)
    data: DataSection = field(default_factory=DataSection)
    moe: MoESection = field(default_factory=MoESection)
    anchor: AnchorConfig = field(default_factory=AnchorConfig)
    optimizer: OptimizerSection = field(default_factory=OptimizerSection)
    scheduler: SchedulerSection = field(default_factory=SchedulerSection)

    @property
    def world_size(self) -> int:
        return self.parallel.nodes * self.parallel.gpus_per_node

    @property
    def data_parallel_size(self) -> int:
        p = self.parallel
        return self.world_size // max(p.tensor * p.pipeline * p.context, 1)

    @property
    def data_file(self) -> Path:
        return Path(self.data.root) / self.data.file


#: the paper's Moonlight setup (section "Experimental setup"); departures become notes
PAPER = {
    "parallel.tensor": 2,
    "parallel.expert": 8,
    "parallel.pipeline": 1,
    "parallel.context": 1,
    "parallel.expert_tensor": 1,
    "world_size": 128,
    "train.global_batch_size": 128,
    "train.micro_batch_size": 1,
    "train.seq_length": 8192,
    "train.steps": 782,
    "moe.score_function": "sigmoid",
    "moe.topk": 6,
    "moe.num_experts": 64,
    "moe.dropless": True,
    "moe.aux_loss_coeff": 0.0,
    "moe.mtp_num_layers": 0,
    "moe.expert_bias": "frozen",
    "anchor.method": "rpb",
    "anchor.beta": 1.0,
    "anchor.eps": 0.05,
    "anchor.c": 5.0,
    "data.packed": False,
}
PAPER_SEEDS = (42, 43, 44)


def _get(cfg: MegatronRunConfig, dotted: str):
    if dotted == "world_size":
        return cfg.world_size
    section, key = dotted.split(".")
    return getattr(getattr(cfg, section), key)


def load_megatron_config(
    path: str | Path | None, overrides: list[str] = (), check_files: bool = False
) -> MegatronRunConfig:
    """Read, override, validate; raise ``ConfigError`` listing every problem. ``cfg.notes`` lists departures."""
    source = str(path) if path else "command line"
    problems: list[str] = []
    tree = read_tree(path, overrides, problems)
    cfg = build_section(MegatronRunConfig, tree, problems)
    problems += validate_megatron_config(cfg)
    if check_files and not problems:
        problems += file_problems(cfg)
    if problems:
        raise ConfigError(source, problems)
    cfg.notes = paper_departures(cfg)
    return cfg


def validate_megatron_config(cfg: MegatronRunConfig) -> list[str]:
    out: list[str] = []
    for key, value in (
        ("model.pretrained_checkpoint", cfg.model.pretrained_checkpoint),
        ("data.root", cfg.data.root),
        ("train.output_dir", cfg.train.output_dir),
        ("model.hf_id", cfg.model.hf_id),
    ):
        if not value:
            out.append(f"{key}: required")
    out += cfg.anchor.problems()
    method = METHODS.get(cfg.anchor.method)  # None: anchor.problems() names it
    if method is not None and method.needs_communities:
        usable = [name for name, m in METHODS.items() if not m.needs_communities]
        out.append(
            f"anchor.method: {cfg.anchor.method!r} needs the base model's co-activation or transition communities, "
            "built from the whole training set through the base model, which this "
            f"example does not build; one of {', '.join(usable)}"
        )
    elif method is not None and method.needs_prior and not cfg.prior:
        out.append(f"prior: required by anchor.method {cfg.anchor.method!r} (collect one with `rpb collect`)")
    if method is not None and method.loss is LBL and cfg.moe.aux_loss_coeff > 0:
        out.append(
            f"moe.aux_loss_coeff: {cfg.moe.aux_loss_coeff}; anchor.method 'lbl' adds the load-balancing loss "
            "itself (anchor.lbl_coef), so Megatron's native one must be off (0)"
        )
    forward_loss = method is not None and method.loss is not None and method.loss.from_forward
    if forward_loss and cfg.train.recompute_granularity == "full":
        out.append(
            "train.recompute_granularity: full recomputation runs the routers' first forward without grad, "
            f"so {method.name}'s loss term could not train them; use selective"
        )

    p, t = cfg.parallel, cfg.train
    sizes = [
        f"parallel.{key}: must be >= 1, got {getattr(p, key)}"
        for key in ("nodes", "gpus_per_node", "tensor", "pipeline", "context", "expert", "expert_tensor")
        if getattr(p, key) < 1
    ]
    sizes += [
        f"train.{key}: must be >= 1, got {getattr(t, key)}"
        for key in ("steps", "global_batch_size", "micro_batch_size", "seq_length", "save_interval", "log_interval")
        if getattr(t, key) < 1
    ]
    if sizes:
        return out + sizes  # the arithmetic below needs positive sizes
    if p.context != 1:
        out.append(f"parallel.context: {p.context}; the Megatron anchor refuses context parallelism (paper: 1)")
    if p.pipeline != 1:
        out.append(f"parallel.pipeline: {p.pipeline}; the Megatron anchor needs pipeline parallelism 1 (paper: 1)")
    model_parallel = p.tensor * p.pipeline * p.context
    if cfg.world_size % model_parallel:
        out.append(f"parallel: world size {cfg.world_size} is not a multiple of tp*pp*cp = {model_parallel}")
    if cfg.world_size % (p.expert * p.expert_tensor * p.pipeline):
        out.append(
            f"parallel: world size {cfg.world_size} is not a multiple of ep*etp*pp = "
            f"{p.expert * p.expert_tensor * p.pipeline}"
        )
    if cfg.moe.num_experts % p.expert:
        out.append(f"parallel.expert: {cfg.moe.num_experts} experts do not split over ep={p.expert}")
    if p.tensor > 1 and not p.sequence_parallel:
        out.append("parallel.sequence_parallel: Megatron's MoE layers need it when tensor > 1")
    if not cfg.world_size % model_parallel and t.global_batch_size % (t.micro_batch_size * cfg.data_parallel_size):
        out.append(
            f"train.global_batch_size: {t.global_batch_size} is not a multiple of micro_batch_size x "
            f"data-parallel size = {t.micro_batch_size} x {cfg.data_parallel_size}"
        )
    if p.sequence_parallel and t.seq_length % p.tensor:
        out.append(f"train.seq_length: {t.seq_length} must be a multiple of tensor={p.tensor} (sequence parallel)")
    if p.sequence_parallel and cfg.data.pad_to_multiple % p.tensor:
        out.append(f"data.pad_to_multiple: {cfg.data.pad_to_multiple} must be a multiple of tensor={p.tensor}")
    if cfg.data.packed:
        out.append("data.packed: this example feeds unpacked single-turn rows (as the paper); set false")
    if cfg.data.pad_to_multiple < 1:
        out.append(f"data.pad_to_multiple: must be >= 1, got {cfg.data.pad_to_multiple}")

    m = cfg.moe
    if m.router_fusion:
        out.append("moe.router_fusion: the fused router kernel bypasses Python routing; the anchor refuses it")
    if m.mtp_num_layers:
        out.append(f"moe.mtp_num_layers: {m.mtp_num_layers}; the prior has no rows for MTP routers, set 0")
    if m.expert_bias == "frozen" and m.score_function != "sigmoid":
        out.append("moe.expert_bias: megatron-core supports an expert bias only with the sigmoid score function")
    if not m.dropless:
        out.append("moe.dropless: this example runs dropless (no capacity factor), as the paper")
    if m.aux_loss_coeff < 0:
        out.append(f"moe.aux_loss_coeff: must be >= 0, got {m.aux_loss_coeff}")
    if not 1 <= m.topk <= m.num_experts:
        out.append(f"moe.topk: must be in [1, num_experts={m.num_experts}], got {m.topk}")

    o, s = cfg.optimizer, cfg.scheduler
    if o.lr <= 0:
        out.append(f"optimizer.lr: must be > 0, got {o.lr}")
    if not 0 <= o.min_lr <= o.lr:
        out.append(f"optimizer.min_lr: must be in [0, lr], got {o.min_lr}")
    for key in ("adam_beta1", "adam_beta2"):
        if not 0 <= getattr(o, key) < 1:
            out.append(f"optimizer.{key}: must be in [0, 1), got {getattr(o, key)}")
    for key in ("adam_eps", "weight_decay", "clip_grad"):
        if getattr(o, key) < 0:
            out.append(f"optimizer.{key}: must be >= 0, got {getattr(o, key)}")
    if s.lr_warmup_iters < 0 or s.lr_decay_iters < s.lr_warmup_iters:
        out.append(
            f"scheduler: need 0 <= lr_warmup_iters <= lr_decay_iters, got {s.lr_warmup_iters} and {s.lr_decay_iters}"
        )
    return out


def file_problems(cfg: MegatronRunConfig) -> list[str]:
    """The files the run reads, the prior as ``rpb validate`` checks the file (values, tensor hash), and its
    metadata against the run (before any GPU is touched)."""
    from rpb.data import file_sha256
    from rpb.prior.artifact import ArtifactError
    from rpb.prior.checks import load_prior

    out = []
    if not Path(cfg.model.pretrained_checkpoint).is_dir():
        out.append(f"model.pretrained_checkpoint: {cfg.model.pretrained_checkpoint} is not a directory")
    if not cfg.data_file.is_file():
        out.append(f"data: {cfg.data_file} does not exist")
    if cfg.prior:
        try:
            meta = load_prior(cfg.prior).metadata
        except (ArtifactError, OSError) as e:
            return [*out, f"prior: {e}"]
        for name, want in (("top_k", cfg.moe.topk), ("num_experts", cfg.moe.num_experts)):
            if meta.get(name) != want:
                out.append(f"prior: {name} is {meta.get(name)!r}, the run's moe section says {want!r}")
        if meta.get("max_seq_len", 0) > cfg.train.seq_length:
            out.append(
                f"prior: collected with max_seq_len={meta.get('max_seq_len')}, longer than "
                f"train.seq_length={cfg.train.seq_length}"
            )
        if cfg.data_file.is_file() and meta.get("data_sha256") != file_sha256(cfg.data_file):
            out.append(f"prior: collected on another data file than {cfg.data_file} (data_sha256 differs)")
    return out


def paper_departures(cfg: MegatronRunConfig) -> list[str]:
    notes = [f"{key}: {_get(cfg, key)!r} (paper: {want!r})" for key, want in PAPER.items() if _get(cfg, key) != want]
    if cfg.train.seed not in PAPER_SEEDS or cfg.data.seed != cfg.train.seed:
        notes.append(f"seeds: train {cfg.train.seed}, data {cfg.data.seed} (paper: both 42, 43 or 44)")
    if cfg.data_file.is_file():
        for suffix in (".idx.npy", ".idx.info"):
            index = cfg.data_file.with_name(cfg.data_file.name + suffix)
            if not index.is_file():
                notes.append(f"data: {index} is missing; build the index files before launch (docs/megatron.md)")
    return notes
