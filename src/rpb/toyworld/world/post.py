"""The toy world's post-training stage: cached base, post-training sets, one anchored run, its scores.

One *cell* of the study is (post-training set, method, seed): ``rpb train`` (``run_training``)
on the set's training rows with the method's anchor, then

* **ID**: exact match on the post-training set's held-out *test* questions;
* **OOD**: mean exact match over the four pretraining domains' held-out *test* questions (what
  post-training destroyed);
* **retention**: ``rpb retention`` of the trained model against the base on a probe set of
  held-out conversations of every domain (TVD, top-k overlap, NMI, ...).

Held-out questions are split once more, by a hash of the question, into *validation* (used
only to choose the anchor weights ``lambda`` / ``lbl_coef``) and *test* (the reported figures).
"""

from __future__ import annotations

import hashlib
import json
import shutil
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Literal

from tqdm.auto import tqdm
from transformers import TrainerCallback

from rpb.anchors import AnchorConfig, get_method
from rpb.data import file_sha256
from rpb.errors import RpbError
from rpb.fileio import atomic_path
from rpb.kernels import SORTED_EXPERTS
from rpb.models import load_causal_lm, load_tokenizer
from rpb.toyworld.world.base import BaseRecipe, default_cache_dir, greedy_answers, pretrain
from rpb.toyworld.world.generators import POST_SETS
from rpb.toyworld.world.knowledge import FACT_TEMPLATES
from rpb.toyworld.world.tasks import (
    DOMAINS,
    TRACE_SETS,
    Task,
    is_correct,
    line_accuracy,
    question_space,
    sample,
    stable_unit,
    to_messages,
)
from rpb.train.config import DataSection, RunConfig, TrainSection

PARTS = ("validation", "test")
#: the seed the data-mixing rows are drawn with (``mixing_tasks``)
MIXING_SEED = 11


class BaseMismatchError(RpbError):
    """A shipped base whose weights do not hash to their pin."""


#: the transform every cell reads its routers with (kl-to-base's distributions): softmax, the one the shipped
#: grids were made with. Pinned in code, not in a recorded setting, so no shipped cell's identity changes; the
#: bases are DeepSeek-V3-shaped, whose family default (normalised sigmoid) would otherwise apply without a prior
ROUTER_TRANSFORM = "softmax"


@dataclass(frozen=True)
class PostRecipe:
    """Post-training and scoring of one cell (the same for every method, set and seed)."""

    #: the paper's math20k / coding20k: 20,000 training conversations, a little under one epoch
    train_rows: int = 20_000
    max_steps: int = 500
    batch_size: int = 32
    lr: float = 3e-4
    warmup_steps: int = 10
    lr_scheduler: str = "cosine"
    max_seq_len: int = 96
    #: held-out questions of the post-training set (ID), per part (validation, test)
    eval_id: int = 100
    #: held-out questions per pretraining domain (OOD), per part; facts has about 75 phrasings per part
    eval_ood: int = 100
    #: the parts every cell is scored on (the test part alone is reported; validation chooses weights)
    score_parts: tuple[str, ...] = ("test",)
    probe_rows: int = 256  # held-out conversations for the retention metrics
    data_seed: int = 0  # the post-training rows (the same for every method and seed)
    base: BaseRecipe = field(default_factory=BaseRecipe)
    #: the post-training cells' kernels: "fast" packs each batch's conversations and runs rpb's experts kernel
    #: (the same step up to float rounding; docs/performance.md), "reference" pads and runs transformers'
    kernels: Literal["fast", "reference"] = "fast"

    @property
    def experts_implementation(self) -> str | None:
        """transformers' experts kernel of the cells' training and scoring (None: transformers' default)."""
        return SORTED_EXPERTS if self.kernels == "fast" else None

    def digest(self) -> str:
        return _digest(asdict(self))


def _digest(obj) -> str:
    return hashlib.sha256(json.dumps(obj, sort_keys=True).encode()).hexdigest()[:12]


# --------------------------------------------------------------------------- base model


def base_dir(recipe: BaseRecipe, cache_dir: Path | None = None) -> Path:
    """Where the base model built by ``recipe`` lives in the cache (named by the recipe's digest)."""
    return Path(cache_dir or default_cache_dir()) / "toyworld" / f"base-{_digest(asdict(recipe))}"


#: the bases shipped with the repository (bases/base<seed>/: an HF checkpoint, its tokenizer and recipe.json),
#: each pinned by its weights' sha256 in bases/bases.json; a base's bits depend on the machine type and the
#: thread count it was built with, so a grid goes on from another machine on the same (shipped) base
SHIPPED_BASES = Path(__file__).resolve().parents[4] / "bases"


def shipped_base(recipe: BaseRecipe, root: Path | None = None) -> Path | None:
    """The shipped copy of the base ``recipe`` builds, or None: the folder of ``root`` (default
    ``SHIPPED_BASES``) pinned for this recipe; its weights must hash to the pin (else ``BaseMismatchError``)."""
    root = SHIPPED_BASES if root is None else root
    pins = root / "bases.json"
    if not pins.is_file():
        return None
    for name, pin in json.loads(pins.read_text()).items():
        where = root / name
        if pin["recipe"] != json.loads(json.dumps(asdict(recipe))):
            continue
        got = file_sha256(where / "model.safetensors")
        if got != pin["weights_sha256"]:
            raise BaseMismatchError(
                f"{where / 'model.safetensors'}: sha256 {got}, pinned {pin['weights_sha256']} in {pins}"
            )
        return where
    return None


def ensure_base(
    recipe: BaseRecipe, cache_dir: Path | None = None, progress: bool = True, shipped: bool = True
) -> tuple[Path, dict]:
    """The cached base model; when absent, the shipped one copied in (``shipped``, when the repository has one
    for ``recipe``), else pretrained (about 10 minutes on 2 CPU cores).

    Either is written to a temporary directory beside the cache entry and renamed into place
    (``rpb.fileio.atomic_path``), so an interrupted build or copy is never mistaken for a finished one;
    it is redone next time. A copy is checked against the pin before it is renamed into place.
    """
    out = base_dir(recipe, cache_dir)
    done = out / "recipe.json"
    if done.is_file():
        record = json.loads(done.read_text())
        if shipped or "shipped" not in record:  # without shipped bases, a cached copy of one is rebuilt
            return out, record
    source = shipped_base(recipe) if shipped else None
    with atomic_path(out, directory=True) as partial:
        if source is None:
            record = pretrain(recipe, partial, progress=progress)
        else:
            shutil.copytree(source, partial, dirs_exist_ok=True)
            if file_sha256(partial / "model.safetensors") != file_sha256(source / "model.safetensors"):
                raise BaseMismatchError(f"{partial}: the copy of {source} does not hash as its source")
            record = json.loads((partial / "recipe.json").read_text()) | {"shipped": str(source)}
            (partial / "recipe.json").write_text(json.dumps(record, indent=1))
    return out, record


# --------------------------------------------------------------------------- data


def part_of(task: Task) -> str:
    """ "validation" or "test" for a held-out question: a hash of its text, half and half."""
    return PARTS[stable_unit(f"part:{task.question}") >= 0.5]


def eval_tasks(domain: str, part: str, n: int, params: dict | None = None) -> list[Task]:
    """Up to ``n`` held-out questions of ``domain`` in ``part`` (the same list every time)."""
    if part not in PARTS:
        raise ValueError(f"part must be one of {PARTS}, got {part!r}")
    kw = (params or {}).get(domain, {})
    # facts has exactly one held-out phrasing per fact (150 with 50 entities): take them all
    want = question_space(domain, **kw) // len(FACT_TEMPLATES) if domain == "facts" else 3 * n
    pool = sample(domain, want, seed=7, split="heldout", **kw)
    return [t for t in pool if part_of(t) == part][:n]


def mixing_tasks(domain: str, n: int, post: PostRecipe) -> list[Task]:
    """``n`` pretraining questions of ``domain`` for data mixing: drawn from its *training* split (what the base
    pretrained on), so none is a validation or test question of any domain (those are held out by the question's
    text, ``tasks.split_of``); a seed of their own, so they are not the first rows pretraining saw."""
    kw = post.base.domain_params().get(domain, {})
    return sample(domain, n, seed=MIXING_SEED, split="train", **kw)


def write_rows(tasks: list[Task], path: Path) -> Path:
    """Tasks as messages-form JSONL rows (written whole, then renamed into place)."""
    with atomic_path(path) as tmp, open(tmp, "w", encoding="utf-8") as f:
        for task in tasks:
            f.write(json.dumps({"messages": to_messages(task)}) + "\n")
    return path


def probe_tasks(post: PostRecipe, trace_set: str | None = None) -> list[Task]:
    """The retention probe: held-out conversations of every domain and both post sets, in equal shares;
    or, for a trace set, its held-out traces alone (transition graphs need long answers, which the
    other sets' few-token answers would only dilute)."""
    params = post.base.domain_params()
    if trace_set is not None:
        return eval_tasks(trace_set, "test", post.probe_rows, params)
    names = DOMAINS + POST_SETS
    per = post.probe_rows // len(names)
    return [t for d in names for t in eval_tasks(d, "test", per, params)]


def between_domain_jsd(base: Path, post: PostRecipe, batch_size: int = 64) -> float:
    """How differently the base routes its four pretraining domains: the Jensen-Shannon divergence (bits)
    between two domains' per-expert utilization on their held-out test questions, averaged over MoE
    layers and the six pairs of domains."""
    from itertools import combinations

    from rpb.data import ChatTemplate, Example
    from rpb.data.dataset import label_row
    from rpb.data.jsonl import MessagesRow
    from rpb.models import load_base_model, pad_id_of
    from rpb.retention.metrics import jsd_bits, shares
    from rpb.retention.run import collect_routing

    tokenizer = load_tokenizer(str(base))
    model, facts = load_base_model(str(base), device="cpu")
    from rpb.adapters import find_moe_layers

    layers = find_moe_layers(model, facts)
    template, params = ChatTemplate(tokenizer), post.base.domain_params()
    load = {}
    for d in DOMAINS:
        tasks = eval_tasks(d, "test", post.probe_rows // len(DOMAINS), params)
        examples = [
            Example(i, *label_row(template, MessagesRow(tuple(to_messages(t))), post.max_seq_len))
            for i, t in enumerate(tasks)
        ]
        stats, _ = collect_routing([model], [layers], examples, batch_size, pad_id_of(tokenizer), progress=False)
        load[d] = stats[0].load_SLE[0]
    values = [
        jsd_bits(shares(load[a][pos]), shares(load[b][pos]))
        for a, b in combinations(DOMAINS, 2)
        for pos in range(len(layers))
    ]
    return sum(values) / len(values)


# --------------------------------------------------------------------------- scoring


def score(model_dir: str | Path, post_set: str, post: PostRecipe, part: str = "test") -> dict:
    """ID / OOD exact match of a checkpoint (greedy), per domain and summarised; a trace set (``TRACE_SETS``)
    is scored on its final line (``id``) and line by line (``id_lines``, the mean ``line_accuracy``)."""
    tokenizer = load_tokenizer(str(model_dir))
    model = load_causal_lm(str(model_dir), experts_implementation=post.experts_implementation)
    params = post.base.domain_params()
    sizes = {post_set: post.eval_id} | dict.fromkeys(DOMAINS, post.eval_ood)
    per_domain, lines = {}, None
    for d, n in sizes.items():
        tasks = eval_tasks(d, part, n, params)
        answers = greedy_answers(model, tokenizer, tasks)
        per_domain[d] = sum(map(is_correct, tasks, answers)) / max(len(tasks), 1)
        if d in TRACE_SETS:
            lines = sum(map(line_accuracy, tasks, answers)) / max(len(tasks), 1)
    ood = sum(per_domain[d] for d in DOMAINS) / len(DOMAINS)
    out = {"id": per_domain[post_set], "ood": ood, "per_domain": per_domain, "part": part}
    return out if lines is None else out | {"id_lines": lines}


def train_cell(
    base: Path,
    data_jsonl: Path,
    prior: Path | None,
    out: Path,
    method: str,
    seed: int,
    post: PostRecipe,
    anchor: dict | None = None,
    progress: bool = True,
    label: str | None = None,
    data_mix: list[dict] | None = None,
) -> tuple[Path, float]:
    """``rpb train`` on one cell (``data_mix``: ``data.mix``'s entries); returns the checkpoint directory and the
    training seconds."""
    from rpb.train.run import run_training

    cfg = RunConfig(
        model=str(base),
        data_jsonl=str(data_jsonl),
        output_dir=str(out),
        prior=str(prior) if prior and get_method(method).needs_prior else None,
        anchor=AnchorConfig(method=method, **({"router_transform": ROUTER_TRANSFORM} | (anchor or {}))),
        train=TrainSection(
            max_steps=post.max_steps,
            seed=seed,
            lr=post.lr,
            batch_size=post.batch_size,
            warmup_steps=post.warmup_steps,
            lr_scheduler=post.lr_scheduler,
            max_seq_len=post.max_seq_len,
            log_every=10,
            deterministic=True,  # a cell redone after a kill scores the same
            experts_implementation=post.experts_implementation,
        ),
        data=DataSection(seed=seed, packing=post.kernels == "fast", mix=list(data_mix or [])),
    )
    started = time.perf_counter()
    run_training(cfg, callbacks=[_StepBar(label or f"{method} seed {seed}", progress)])
    return out, time.perf_counter() - started


def mechanism(base: Path, ckpt: Path, prior: Path, data_jsonl: Path, rows: int = 256) -> dict:
    """What the cell's training did to the base's routing, beside its scores: from its ``log.jsonl``,
    the displacement of content tokens its bias would cause on the base before the first step
    (``calibrate/displacement``; None without a prior) and the mean fraction it changed during
    training (``moe/layer_*/bias_changed_fraction``, over logging windows and layers); after training, on a seeded
    sample of training rows, the overlap of the trained routing with the base's own sets and with the
    span prior's top-k (``rpb.calibrate.agreement``)."""
    from rpb.calibrate.agreement import training_rows_agreement

    start, changed = None, []
    for line in (ckpt / "log.jsonl").read_text().splitlines():
        record = json.loads(line)
        start = record.get("calibrate/displacement", start)
        changed += [v for k, v in record.items() if k.startswith("moe/layer_") and k.endswith("/bias_changed_fraction")]
    agreement = training_rows_agreement(base, ckpt, prior, data_jsonl, rows=rows)
    return {
        "start_displacement": start,
        "bias_changed": sum(changed) / len(changed) if changed else None,
        "overlap_base": agreement["mean_overlap_base"],
        "overlap_prior": agreement["mean_overlap_prior"],
        "layers": {"overlap_base": agreement["overlap_base"], "overlap_prior": agreement["overlap_prior"]},
    }


class _StepBar(TrainerCallback):
    """One progress bar per post-training run (instead of the Trainer's own bar and log lines)."""

    def __init__(self, desc: str, enabled: bool):
        self.desc, self.enabled, self.bar = desc, enabled, None

    def on_train_begin(self, args, state, control, **kwargs):
        self.bar = tqdm(total=state.max_steps, desc=self.desc, unit="step", leave=False, disable=not self.enabled)

    def on_step_end(self, args, state, control, **kwargs):
        self.bar.update(1)

    def on_log(self, args, state, control, logs=None, **kwargs):
        if logs and "loss" in logs:
            self.bar.set_postfix(loss=f"{logs['loss']:.3f}", refresh=False)

    def on_train_end(self, args, state, control, **kwargs):
        self.bar.close()
