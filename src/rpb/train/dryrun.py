"""``rpb train --dry-run``: everything a real run would refuse that can be found without the model.

A real run stops at the first stage that fails (configuration, prior, rows, prior against the run);
the dry run goes through every stage it can and lists every problem at once: the configuration, the
tokenizer, the prior's file (metadata, values, tensor hash: ``rpb validate``) and data (sha256, rows),
every row rendered and labelled as the run labels it, the prior's settings against the run's (chat
template, its keyword arguments, max_seq_len: ``rpb.anchors.verify_prior``), and the expert configs the
run reads. The model is not loaded, so what only its weights tell (the routers' fingerprint, top-k, MoE
layers, experts) is left unchecked, and the report says so.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

from rpb.errors import RpbError
from rpb.train.config import RunConfig, build_section, read_tree, validate

#: what only the model's weights tell, left to the real run (or ``rpb validate --expected-model``)
UNCHECKED = (
    "not checked without the model's weights: the prior's routers fingerprint (routers_sha256), top-k, MoE "
    "layers and experts against the model (`rpb validate PRIOR --expected-model MODEL` checks them from the "
    "checkpoint's files)"
)


#: ``verify_prior``'s fields that the model's weights decide
MODEL_FIELDS = ("model", "routers_sha256", "top_k", "moe_layers", "num_experts")


#: said instead, where the model's checkpoint files were at hand
CHECKED = (
    "  the prior's routers fingerprint, top-k, MoE layers and experts: checked against the model's checkpoint files"
)


class DryRunError(RpbError):
    """Everything a real ``rpb train`` of this configuration would refuse, listed at once."""

    def __init__(self, source: str, problems: list[str], model_checked: bool = False, prior: bool = True):
        self.problems = problems
        lines = [f"{source}: {len(problems)} problem(s) a real run would refuse:", *(f"  - {p}" for p in problems)]
        super().__init__("\n".join([*lines, *model_note(prior, model_checked)]))


def model_note(prior: bool, model_checked: bool) -> list[str]:
    """What the dry run says of the prior's model fields: nothing where the run reads no prior."""
    return [CHECKED if model_checked else UNCHECKED] if prior else []


@dataclass
class DryRun:
    """What the dry run found: ``problems`` (empty: a real run would start) and what it checked."""

    source: str
    cfg: RunConfig
    problems: list[str] = field(default_factory=list)
    rows: int | None = None
    truncated_rows: int | None = None
    max_seq_len: int | None = None
    #: the prior's model fields were checked against the model's checkpoint files
    model_checked: bool = False
    #: ``data.mix``'s record (``rpb.data.mix``), where the run mixes rows
    mixed: dict | None = None
    #: routing-kd / output-kd: what the base is read from (``rpb.teacher``), as the run will record it
    base: str | None = None

    def summary(self) -> str:
        lines = [f"{self.source}: configuration OK (anchor.method={self.cfg.anchor.method})"]
        if self.rows is not None:
            lines.append(f"  {self.rows} row(s) labelled, {self.truncated_rows} cut to max_seq_len={self.max_seq_len}")
        if self.mixed is not None:
            taken = ", ".join(f"{s['rows']} of {s['path']}" for s in self.mixed["sources"][1:])
            lines.append(f"  data.mix: {taken} in the places of as many training rows (seed {self.mixed['seed']})")
        if self.cfg.prior:
            lines.append(f"  prior {self.cfg.prior}: file, values and data OK; chat template and settings match")
        if self.base is not None:
            lines.append(f"  base: {self.base}")
        return "\n".join([*lines, *model_note(bool(self.cfg.prior), self.model_checked)])


def dry_run(path: str | Path | None, overrides: list[str] = ()) -> DryRun:
    """Check ``path`` (YAML) with ``overrides`` as ``rpb train`` would, without the model; raises
    ``DryRunError`` listing every problem, else returns what was checked."""
    problems: list[str] = []
    tree = read_tree(path, list(overrides), problems)  # an unreadable file raises: nothing else to check
    cfg = build_section(RunConfig, tree, problems)
    problems += validate(cfg)
    report = DryRun(str(path) if path else "command line", cfg, problems)
    tokenizer = _tokenizer(cfg, problems)
    meta = _prior(cfg, problems)
    max_seq_len = cfg.train.max_seq_len or (meta or {}).get("max_seq_len")
    if not (isinstance(max_seq_len, int) and max_seq_len >= 2):
        max_seq_len = None  # named already: train.max_seq_len, or the prior's metadata
    if tokenizer is not None and max_seq_len is not None and Path(cfg.data_jsonl).is_file():
        data = _rows(cfg, tokenizer, max_seq_len, (meta or {}).get("chat_template_date"), problems)
        if data is not None:
            report.rows, report.truncated_rows, report.max_seq_len = data.num_rows, data.truncated_rows, max_seq_len
            report.mixed = _mix(cfg, data, tokenizer, max_seq_len, problems)
            report.base = _base(cfg, data, problems)
    if tokenizer is not None and meta is not None:
        _settings(cfg, tokenizer, meta, max_seq_len, problems)
    if meta is not None and cfg.model:
        report.model_checked = _model_fields(cfg, meta, problems)
    for where, choice in (("train.only_experts", cfg.train.only_experts), ("lora.experts", cfg.lora.experts_from)):
        if choice:
            from rpb.experts import read_choice

            try:
                read_choice(choice)
            except RpbError as e:
                problems.append(f"{where}: {e}")
    if problems:
        raise DryRunError(report.source, problems, report.model_checked, prior=bool(cfg.prior))
    return report


def _model_fields(cfg: RunConfig, meta: dict, problems: list[str]) -> bool:
    """The prior's routers fingerprint, top-k, MoE layers and experts against the model's checkpoint files, where
    they are on this machine (a folder, or a hub id in the local cache: nothing is downloaded), reading the router
    tensors alone; False where they are not (the real run checks them once it has the model)."""
    from rpb.prior.artifact import ArtifactError
    from rpb.train.validate import check_model, model_dir_of

    try:
        model_dir_of(cfg.model)
    except ArtifactError:
        return False
    found: list[str] = []
    check_model(meta, cfg.model, found)
    problems += [f"prior: {p}" for p in found]
    return True


def _tokenizer(cfg: RunConfig, problems: list[str]):
    from rpb.models import load_tokenizer

    name = cfg.tokenizer or cfg.model
    if not name:
        return None  # "model: required" is among the problems already
    try:
        return load_tokenizer(name, cfg.trust_remote_code)
    except RpbError as e:
        problems.append(f"tokenizer: {e}")
        return None


def _prior(cfg: RunConfig, problems: list[str]) -> dict | None:
    """The prior's problems (``rpb validate``'s checks of the file and the data) and its metadata, read even
    where its values are refused (a real run stops there; the dry run goes on to the rows and settings)."""
    if not cfg.prior or not Path(cfg.prior).is_file():
        return None  # a missing prior is among the configuration's problems
    from rpb.prior.artifact import ArtifactError, load_artifact
    from rpb.train.validate import validate_artifact

    data = cfg.data_jsonl if cfg.data_jsonl and Path(cfg.data_jsonl).is_file() else None
    problems += [f"prior: {p}" for p in validate_artifact(cfg.prior, data_jsonl=data).problems]
    try:
        meta = load_artifact(cfg.prior).metadata
    except (ArtifactError, OSError):
        return None  # validate named why
    return meta if isinstance(meta, dict) else None


def _rows(cfg: RunConfig, tokenizer, max_seq_len: int, date: str | None, problems: list[str]):
    """Every row rendered and labelled as the run labels it; each bad row as the run reports it."""
    from rpb.data import DataError, load_labelled

    try:
        return load_labelled(cfg.data_jsonl, tokenizer, max_seq_len, cfg.data.chat_template_kwargs, date)
    except DataError as e:
        problems += [f"data_jsonl: {row.format(e.path)}" for row in e.errors]
    except RpbError as e:  # a template that cannot locate content at all
        problems.append(f"data_jsonl: {e}")
    return None


def _mix(cfg: RunConfig, data, tokenizer, max_seq_len: int, problems: list[str]) -> dict | None:
    """``data.mix`` as the run mixes it: each extra file labelled (its bad rows named by their field), each share
    against the file's rows; the mix's record where all is well."""
    from rpb.data import DataError, load_labelled
    from rpb.data.mix import mix, mix_problems, mix_sources

    if not cfg.data.mix or mix_problems(cfg.data.mix):  # none, or named already by validate
        return None
    extras = []
    for i, source in enumerate(mix_sources(cfg.data.mix)):
        try:
            extras.append((source, load_labelled(source.path, tokenizer, max_seq_len, cfg.data.chat_template_kwargs)))
        except DataError as e:
            problems += [f"data.mix[{i}].path: {row.format(e.path)}" for row in e.errors]
    if len(extras) < len(cfg.data.mix):
        return None
    try:
        return mix(data, extras, cfg.data.seed).record
    except RpbError as e:
        problems += [f"data.mix: {p}" for p in getattr(e, "problems", [str(e)])]  # the files too short
    return None


def _base(cfg: RunConfig, data, problems: list[str]) -> str | None:
    """routing-kd / output-kd's base as the run reads it: the route file against the training file's labelling and
    the checkpoint's routers (read from its files alone, where they are at hand), or the frozen copy's dtype against
    the device; a line for the summary where all is well."""
    from rpb.anchors import METHODS

    method = METHODS.get(cfg.anchor.method)
    if method is None or method.teacher is None or cfg.anchor.base not in ("online", "routes"):
        return None  # no base to read, or named already by validate
    from rpb.teacher.lineage import lineage_problems

    problems += lineage_problems(cfg.model, cfg.anchor.trained_base)
    if cfg.anchor.base == "online":
        import torch

        from rpb.teacher.online import dtype_problems

        device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
        found = dtype_problems(cfg.anchor.base_dtype, device)
        problems += found
        if cfg.lora.enabled:
            return "online: the model with its LoRA adapters disabled (no second copy)"
        return None if found else f"online: a frozen copy of {cfg.model} ({cfg.anchor.base_dtype or cfg.train.dtype})"
    if not cfg.anchor.routes or not Path(cfg.anchor.routes).exists():
        return None  # named by validate
    return _stored_routes(cfg, data, problems)


def _stored_routes(cfg: RunConfig, data, problems: list[str]) -> str | None:
    from transformers import AutoConfig

    from rpb.adapters import checkpoint_routers_sha256, get_adapter
    from rpb.anchors.transform import run_transform
    from rpb.losses import routes_loss_form
    from rpb.prior.artifact import ArtifactError
    from rpb.teacher import load_stored_routes
    from rpb.train.validate import model_dir_of

    try:
        model_dir = model_dir_of(cfg.model)
    except ArtifactError:
        problems.append(
            f"anchor.routes: the model {cfg.model} is not on this machine, so its routers cannot be read to check the "
            "route file; the real run checks it"
        )
        return None
    ck = checkpoint_routers_sha256(model_dir, cfg.adapter)
    config = AutoConfig.from_pretrained(str(model_dir)).get_text_config()
    facts = get_adapter(ck.adapter)
    try:
        stored = load_stored_routes(
            cfg.anchor.routes,
            data,
            routers_sha256=ck.routers_sha256,
            moe_layers=ck.moe_layers,
            num_layers=int(config.num_hidden_layers),
            top_k=ck.top_k,
            num_experts=ck.num_experts,
            transform=run_transform(cfg.anchor.router_transform, None, facts.score_function),
            routes_loss=cfg.anchor.routes_loss,
        )
    except RpbError as e:
        problems.append(str(e))
        return None
    probs = "top-k and router probabilities" if stored.with_probs else "top-k ids alone"
    probs += f" at {stored.top_m} experts per token" if stored.top_m > stored.top_k else ""
    form = routes_loss_form(cfg.anchor.routes_loss, stored.with_probs)
    return (
        f"routes {cfg.anchor.routes}: {probs} (the term: {form}), every row's tokens and routes match the training "
        "file and model"
    )


def _settings(cfg: RunConfig, tokenizer, meta: dict, max_seq_len, problems: list[str]) -> None:
    """The prior against the run as ``verify_prior`` judges it, but for the model's fields (unchecked) and the
    data's (``rpb validate`` judged them, with more detail)."""
    from rpb.anchors import PriorMismatchError, RunFacts, verify_prior
    from rpb.data import ChatTemplate

    try:
        template_sha256 = ChatTemplate(tokenizer).sha256
    except RpbError as e:
        problems.append(f"tokenizer: {e}")
        return
    run = RunFacts(
        data_sha256=meta.get("data_sha256"),
        num_rows=meta.get("num_rows"),
        model=cfg.model,
        routers_sha256="",
        tokenizer=cfg.tokenizer or cfg.model,
        chat_template_sha256=template_sha256,
        chat_template_kwargs=cfg.data.chat_template_kwargs,
        top_k=0,
        max_seq_len=max_seq_len,
        moe_layers=[],
        num_experts=0,
    )
    try:
        verify_prior(meta, run, cfg.prior)
    except PriorMismatchError as e:
        problems += [
            f"prior: {name}: the prior has {old!r}, this run has {new!r}"
            for name, old, new in e.mismatches
            if name not in MODEL_FIELDS
        ]
