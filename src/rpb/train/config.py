"""``rpb train`` configuration: YAML + dotted command-line overrides, validated up front.

Every problem (unknown key, wrong type, missing requirement, bad value, missing file) is
collected and reported in one ``ConfigError`` before anything is loaded or run.
"""

from __future__ import annotations

import dataclasses
import types
import typing
from dataclasses import dataclass, field
from pathlib import Path

import yaml

from rpb.anchors.config import AnchorConfig
from rpb.anchors.methods import METHODS
from rpb.data.batches import LossOn
from rpb.errors import ConfigError
from rpb.models import DtypeName
from rpb.monitor.routing import MonitorConfig
from rpb.prior import ROUTER_TRANSFORMS
from rpb.train.lora import LoraSection

# YAML spells Python's reserved word as "lambda"
_KEY_ALIASES = {"lambda": "lambda_"}


@dataclass
class TrainSection:
    max_steps: int = 100
    seed: int = 42
    lr: float = 1e-5
    batch_size: int = 8
    grad_accum: int = 1
    loss_on: LossOn = "answer"
    gradient_checkpointing: bool = False
    #: None: the prior's max_seq_len (they must agree); required for methods without a prior
    max_seq_len: int | None = None
    log_every: int = 10
    report_to: list[str] = field(default_factory=lambda: ["none"])
    dtype: DtypeName = "float32"
    weight_decay: float = 0.0
    warmup_steps: int = 0
    lr_scheduler: str = "constant"
    save: bool = True
    #: passed to TrainingArguments.fsdp / fsdp_config (e.g. "full_shard auto_wrap", {"version": 2})
    fsdp: str = ""
    fsdp_config: dict | None = None
    #: rows sampled before the first step to measure how far this run's bias moves the base's own expert
    #: choice (counterfactual displacement over content tokens, logged as calibrate/displacement); 0: off
    calibrate_rows: int = 256
    #: warn when that mean displacement is above this: the beta rule's limit (rpb.calibrate.rule), where
    #: the bias stops holding the base's routing and starts replacing it with the span average
    displacement_warn: float = 0.5
    #: deterministic kernels while training (torch.use_deterministic_algorithms): the same run
    #: twice gives the same weights bit for bit. On CPU the MoE backward otherwise accumulates
    #: in thread order; on GPU some ops then raise instead of running nondeterministically
    deterministic: bool = False
    #: save a resumable checkpoint (weights, optimizer, scheduler, RNG, data position) every this many
    #: steps into output_dir/checkpoint-<step>/; 0: none (the final model is saved either way)
    save_every: int = 0
    #: "auto": resume from the newest complete checkpoint in output_dir (none: start fresh); or a
    #: checkpoint directory; None: start fresh. The set-up must be the checkpoint's (rpb.train.checkpoints)
    resume_from_checkpoint: str | None = None
    #: an ESFT-style expert config (``rpb experts``): full fine-tuning moves only the routed experts it names
    #: (the others' gradients masked and kept out of weight decay: bit-identical after training), and the
    #: shared experts and non-expert modules only where its flags say. With LoRA use lora.experts.from
    only_experts: str | None = None
    #: transformers' kernel for the MoE experts (None: its default, grouped_mm); "rpb_sorted" is rpb's
    #: (rpb.kernels.experts: faster on CPU, and unpacked batches' padding gets no expert work)
    experts_implementation: str | None = None


@dataclass
class DataSection:
    seed: int = 42
    packing: bool = False
    #: the chat template's keyword arguments (``enable_thinking: true``, ``thinking: true``,
    #: ``reasoning_effort: high``): passed to every rendering; must equal the prior's
    chat_template_kwargs: dict = field(default_factory=dict)
    #: other JSONL files whose rows take the places of some of the training file's (``rpb.data.mix``): a list of
    #: ``{path: FILE, share: FRACTION}``, the shares of the training rows each takes (the rows and steps stay
    #: the training file's); drawn with ``seed``, the order recorded in ``rpb_run.json``
    mix: list[dict] = field(default_factory=list)


@dataclass
class RunConfig:
    model: str = ""
    data_jsonl: str = ""
    output_dir: str = ""
    prior: str | None = None
    tokenizer: str | None = None
    adapter: str | None = None
    trust_remote_code: bool = False
    anchor: AnchorConfig = field(default_factory=AnchorConfig)
    train: TrainSection = field(default_factory=TrainSection)
    data: DataSection = field(default_factory=DataSection)
    lora: LoraSection = field(default_factory=LoraSection)
    #: the routing monitor (``rpb.monitor``): on where a ``monitor:`` section asks for it, or unasked where the base's
    #: routing is at hand (``routing-kd``); ``monitor.enabled: false`` turns it off
    monitor: MonitorConfig = field(default_factory=MonitorConfig)


def _accepts(tp, value) -> bool:
    origin = typing.get_origin(tp)
    if origin is typing.Literal:
        return value in typing.get_args(tp)
    if origin in (typing.Union, types.UnionType):
        return any(_accepts(a, value) for a in typing.get_args(tp))
    if tp is type(None):
        return value is None
    if origin is list:
        (item,) = typing.get_args(tp)
        return isinstance(value, list) and all(_accepts(item, v) for v in value)
    if tp is float:
        return isinstance(value, (int, float)) and not isinstance(value, bool)
    if tp is int:
        return isinstance(value, int) and not isinstance(value, bool)
    return isinstance(value, tp)


def _yaml_float(value):
    """YAML 1.1 reads ``1e-5`` (no dot) as a string; for float fields, read it as the number it is."""
    if isinstance(value, str):
        try:
            return float(value)
        except ValueError:
            return value
    return value


def _describe(tp) -> str:
    """A type as a config problem names it: ``one of 'answer', 'all'``, ``float or None``, ``int``."""
    origin = typing.get_origin(tp)
    if origin is typing.Literal:
        return "one of " + ", ".join(repr(a) for a in typing.get_args(tp))
    if origin in (typing.Union, types.UnionType):
        return " or ".join(_describe(a) for a in typing.get_args(tp))
    if tp is type(None):
        return "None"
    return getattr(tp, "__name__", str(tp))


def build_section(cls, data: dict, problems: list[str], prefix: str = ""):
    """``cls(**data)`` for a dataclass of config fields (nested dataclasses are sections), checking
    every key and value against the field types (``Literal`` values included); each problem is added
    to ``problems`` and the field keeps its default."""
    if not isinstance(data, dict):
        problems.append(f"{prefix or 'config'}: expected a mapping, got {type(data).__name__}")
        return cls()
    hints = typing.get_type_hints(cls)
    fields = {f.name: f for f in dataclasses.fields(cls)}
    kwargs = {}
    for key, value in data.items():
        name = _KEY_ALIASES.get(key, key)
        where = f"{prefix}{key}"
        if name not in fields:
            problems.append(f"{where}: unknown key (known: {', '.join(k.rstrip('_') for k in fields)})")
            continue
        tp = hints[name]
        value = _yaml_float(value) if _accepts(tp, 0.5) else value
        if dataclasses.is_dataclass(tp):
            kwargs[name] = build_section(tp, value, problems, f"{where}.")
        elif _accepts(tp, value):
            kwargs[name] = float(value) if tp is float else value
        else:
            problems.append(f"{where}: expected {_describe(tp)}, got {value!r}")
    return cls(**kwargs)


def _set_dotted(tree: dict, dotted: str, raw: str, problems: list[str]) -> None:
    keys = dotted.split(".")
    if not all(keys):
        problems.append(f"override {dotted!r}: expected key.sub=value with no empty key")
        return
    try:
        value = yaml.safe_load(raw) if raw != "" else None
    except yaml.YAMLError as e:
        problems.append(f"override {dotted}: the value {raw!r} is not YAML ({str(e).splitlines()[0]})")
        return
    node = tree
    for k in keys[:-1]:
        node = node.setdefault(k, {})
        if not isinstance(node, dict):
            problems.append(f"override {dotted}: {k} is not a section")
            return
    node[keys[-1]] = value


def read_tree(path: str | Path | None, overrides: list[str], problems: list[str]) -> dict:
    """The YAML mapping of ``path`` (empty without one) with ``key.sub=value`` overrides applied.

    An unreadable file raises ``ConfigError`` at once; bad overrides are added to ``problems``.
    """
    tree: dict = {}
    if path is not None:
        try:
            tree = yaml.safe_load(Path(path).read_text()) or {}
        except (OSError, UnicodeDecodeError, yaml.YAMLError) as e:
            raise ConfigError(str(path), [f"cannot read: {e}"]) from None
        if not isinstance(tree, dict):
            raise ConfigError(str(path), [f"expected a mapping of sections, got {type(tree).__name__}"])
    for item in overrides:
        if "=" not in item:
            hint = f" (a YAML file is given as --config {item})" if item.endswith((".yaml", ".yml")) else ""
            problems.append(f"override {item!r}: expected key.sub=value{hint}")
            continue
        key, raw = item.split("=", 1)
        _set_dotted(tree, key.strip(), raw, problems)
    return tree


def load_config(path: str | Path | None, overrides: list[str] = ()) -> RunConfig:
    """Read ``path`` (YAML), apply ``key.sub=value`` overrides, validate; raise ConfigError listing all problems."""
    problems: list[str] = []
    source = str(path) if path else "command line"
    tree = read_tree(path, overrides, problems)
    cfg = build_section(RunConfig, tree, problems)
    if isinstance(tree.get("monitor"), dict) and "enabled" not in tree["monitor"]:
        cfg.monitor.enabled = True  # a monitor: section (or a monitor.* override) asks for the monitor
    problems += validate(cfg)
    if problems:
        raise ConfigError(source, problems)
    return cfg


def anchor_problems(anchor: AnchorConfig, prior: str | None, where: str = "") -> list[str]:
    """The anchor's own problems and its prior's (required by the method, present on disk); each key is
    prefixed with ``where`` (the section holding ``anchor`` and ``prior``)."""
    out = [f"{where}{p}" for p in anchor.problems()]
    method = METHODS.get(anchor.method)  # None: anchor.problems() names it
    if method is not None and method.needs_prior and not prior:
        out.append(f"{where}prior: required by anchor.method {method.name!r} (collect one with `rpb collect`)")
    if prior and not Path(prior).is_file():
        out.append(f"{where}prior: {prior} does not exist")
    routes = anchor.routes if method is not None and method.teacher and anchor.base == "routes" else None
    if routes and not Path(routes).exists():  # a route file, or a shard directory
        out.append(f"{where}anchor.routes: {anchor.routes} does not exist")
    return out


def validate(cfg: RunConfig) -> list[str]:
    out = []
    for key in ("model", "data_jsonl", "output_dir"):
        if not getattr(cfg, key):
            out.append(f"{key}: required")
    if cfg.data_jsonl and not Path(cfg.data_jsonl).is_file():
        out.append(f"data_jsonl: {cfg.data_jsonl} does not exist")
    out += anchor_problems(cfg.anchor, cfg.prior)
    method = METHODS.get(cfg.anchor.method)  # None: anchor_problems named it
    if cfg.data.mix:
        from rpb.data.mix import mix_problems

        out += mix_problems(cfg.data.mix)
        if method is not None and method.needs_prior:
            out.append(
                f"data.mix: anchor.method {method.name!r} reads a prior, which covers the training file row by row "
                "and none of the mixed rows; mix with a method that reads no prior"
            )
        if method is not None and method.teacher and cfg.anchor.base == "routes":
            out.append(
                "data.mix: anchor.base=routes reads a route file of the training file, which holds none of the mixed "
                "rows' routes; mix with anchor.base=online"
            )
    if not cfg.prior and cfg.train.max_seq_len is None:
        out.append("train.max_seq_len: required when there is no prior to take it from")
    t = cfg.train
    for key in ("max_steps", "batch_size", "grad_accum", "log_every"):
        if getattr(t, key) < 1:
            out.append(f"train.{key}: must be >= 1, got {getattr(t, key)}")
    if t.save_every < 0:
        out.append(f"train.save_every: must be >= 0 (0: no checkpoints), got {t.save_every}")
    rc = t.resume_from_checkpoint
    if rc not in (None, "auto") and not (Path(rc) / "rpb_checkpoint.json").is_file():
        out.append(f"train.resume_from_checkpoint: {rc} is not a complete rpb checkpoint (see auto)")
    if t.calibrate_rows < 0:
        out.append(f"train.calibrate_rows: must be >= 0 (0: off), got {t.calibrate_rows}")
    if t.max_seq_len is not None and t.max_seq_len < 2:
        out.append(f"train.max_seq_len: must be >= 2, got {t.max_seq_len}")
    if t.lr <= 0:
        out.append(f"train.lr: must be > 0, got {t.lr}")
    if t.experts_implementation is not None:
        from rpb.kernels import registered

        if t.experts_implementation not in registered():
            out.append(f"train.experts_implementation: {t.experts_implementation!r} is not one of {registered()}")
    out += cfg.lora.problems()
    if cfg.monitor.every_n_steps < 1:
        out.append(f"monitor.every_n_steps: must be >= 1, got {cfg.monitor.every_n_steps}")
    if cfg.monitor.router_transform is not None and cfg.monitor.router_transform not in ROUTER_TRANSFORMS:
        out.append(f"monitor.router_transform: one of {ROUTER_TRANSFORMS}, got {cfg.monitor.router_transform!r}")
    if cfg.train.only_experts and cfg.lora.enabled:
        out.append("train.only_experts: full fine-tuning of chosen experts; with LoRA use lora.experts.from")
    if cfg.lora.enabled and method is not None and method.freeze_router and cfg.lora.router != "none":
        out.append(f"lora.router: {cfg.lora.router!r} trains the router, which anchor.method {method.name!r} freezes")
    return out
