"""A reinforcement-learning grid (``RLGrid``) and one base of it (``RLStudy``): GRPO arms from each base's ``sft``
cell, resumable cell by cell.

Per base, in order (every file written atomically, once, and read back after):

1. **the start** (``start/``): the base's ``sft`` cell on the grid's set at ``start_seed``, trained as the paper's
   grids train it, always at one intra-op thread (the paper's grids' lanes ran at one, and a cell's bits follow
   the thread count), its weights' sha256 and test / validation scores in ``start/record.json``. No checkpoint of
   it ships: a resumed base trains it again and must get the recorded sha256, or the base is refused;
2. **the prompts** (``data/rl_prompts.jsonl``, ``world.rl.rl_prompts``) and the ``rpb`` arm's **prior**, collected with
   the *start* over the prompts (the routing the RL run starts from, as a user collects it from the model they
   post-train);
3. **the anchor weights** (``lbl``, ``kl-to-base``): each candidate trains GRPO at the first seed and is scored on
   the validation part (mean of ID and OOD), as the other grids choose them (``selection.json``);
4. **the cells**: each arm x seed, scored on the validation and test parts, with the routing retention against
   the base and against the start on the probe set (``base_*`` / ``start_*``: TVD, JSD, top-k overlap, NMI) and
   the training's flip rate and log-probability gap beside them (``retention``: what the grid's claims read).
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import shutil
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import ClassVar

import torch

from rpb.anchors import get_method
from rpb.data import file_sha256
from rpb.errors import RpbError
from rpb.fileio import write_json_atomic
from rpb.toyworld.study.cells import Study, _NoBar
from rpb.toyworld.study.grid import UNPINNED, Conduct, table_weights
from rpb.toyworld.study.rl_report import report_rl
from rpb.toyworld.world.base import machine
from rpb.toyworld.world.post import PostRecipe, score, train_cell, write_rows
from rpb.toyworld.world.rl import RLArm, RLRecipe, rl_prompts, train_rl_cell
from rpb.toyworld.world.tasks import Task

#: the retention metrics a cell keeps, against the base and against its start
RETENTION_KEYS = ("tvd", "jsd", "topk_overlap", "nmi")


class StartChangedError(RpbError):
    """A retrained start differs from the one the base's finished cells started from."""


@contextlib.contextmanager
def _threads(n: int):
    before = torch.get_num_threads()
    torch.set_num_threads(n)
    try:
        yield
    finally:
        torch.set_num_threads(before)


@dataclasses.dataclass
class RLStudy(Study):
    """One base of an ``RLGrid``."""

    #: what a base ships besides the grids' files (``study.shipping``): its start's record
    ships: ClassVar[tuple[str, ...]] = ("start/record.json",)

    # ------------------------------------------------------------------ inputs

    @property
    def post_set(self) -> str:
        return self.grid.sets[0]

    def start(self) -> Path:
        """The start's checkpoint (trained here if absent), checked against ``start/record.json``'s sha256. The
        record is written last: a start without one (cut short before it) is trained again."""
        where, record_path = self.out / "start", self.out / "start" / "record.json"
        model = where / "model"
        recorded = json.loads(record_path.read_text()) if record_path.is_file() else None
        if recorded is None or not (model / "model.safetensors").is_file():
            shutil.rmtree(model, ignore_errors=True)
            with _threads(1):
                data, seed = self.data(self.post_set), self.grid.start_seed
                _, seconds = train_cell(self.base(), data, None, model, "sft", seed, self.post, progress=False)
            sha = file_sha256(model / "model.safetensors")
            if recorded is not None and recorded["weights_sha256"] != sha:
                raise StartChangedError(
                    f"{record_path}: the start trained here has weights {sha[:12]}, the recorded one "
                    f"{recorded['weights_sha256'][:12]} (another machine type or torch build?): the base's finished "
                    "cells started from the recorded one; use a new --out"
                )
            if recorded is None:
                scores = {p: score(model, self.post_set, self.post, p) for p in self.post.score_parts}
                write_json_atomic(
                    record_path,
                    {
                        "set": self.post_set,
                        "method": "sft",
                        "seed": self.grid.start_seed,
                        "weights_sha256": sha,
                        "scores": scores,
                        "seconds": seconds,
                        "threads": 1,
                        "machine": machine(),
                        "torch": torch.__version__,
                    },
                )
        return model

    def start_record(self) -> dict:
        return json.loads((self.out / "start" / "record.json").read_text())

    def tasks(self) -> list[Task]:
        return rl_prompts(self.post_set, self.data(self.post_set), self.grid.recipe)

    def prompts(self) -> Path:
        path = self.out / "data" / "rl_prompts.jsonl"
        if not path.is_file():
            write_rows(self.tasks(), path)
        return path

    def rl_prior(self) -> Path:
        """The prior of the start's routing over the prompts (what ``rpb`` reads, ``prepare_grpo``)."""
        from rpb.collect import collect

        path = self.out / "priors" / "rl_prompts.safetensors"
        if not path.is_file():
            collect(
                str(self.start()),
                self.prompts(),
                path,
                top_k=self.post.base.num_experts_per_tok,
                max_seq_len=self.grid.recipe.max_seq_len,
                batch_size=64,
                progress=False,
            )
        return path

    def inputs(self) -> None:
        """The start, the prompts and the prior, before any cell (every lane reads them)."""
        self.rl_prior()

    # ------------------------------------------------------------------ cells

    def selection_arm(self, method: str) -> RLArm:
        """The grid's arm of a weighted method (``grpo + lbl``), which its selection runs train."""
        return next(a for a in self.grid.arms if a.method == method)

    def train(self, where: Path, post_set: str, arm: RLArm, seed: int, anchor: dict) -> tuple[Path, float, dict]:
        """GRPO of ``arm`` from the start into ``where/model``; the cell's record adds the start's hash and the
        run's per-step figures and settings (``rl.train_rl_cell``)."""
        prior = self.rl_prior() if get_method(arm.method).needs_prior else None
        record = train_rl_cell(
            self.start(),
            self.prompts(),
            self.tasks(),
            where,
            arm,
            seed,
            self.grid.recipe,
            anchor,
            prior,
            self.grid.collapsed,
        )
        shutil.rmtree(where / "trl", ignore_errors=True)  # TRL's output folder: nothing is saved there
        return where / "model", record["seconds"], {"start_sha256": self.start_record()["weights_sha256"], "rl": record}

    def measure(self, where: Path, ckpt: Path, post_set: str, result: dict) -> dict:
        """The routing retention on the probe set against the base and against the start (``base_*`` /
        ``start_*``), with the training's mean flip rate and log-probability gap beside them."""
        from rpb.retention.run import run_retention

        retention = {}
        for name, reference in (("base", self.base()), ("start", self.start())):
            report = run_retention(
                str(reference),
                self.probe(),
                where / f"retention_{name}",
                post=str(ckpt),
                batch_size=64,
                max_seq_len=self.post.max_seq_len,
                progress=False,
            )
            retention |= {f"{name}_{k}": report["mean"][k] for k in RETENTION_KEYS}
            shutil.rmtree(where / f"retention_{name}", ignore_errors=True)
        summary = result["rl"]["summary"]
        # a cell from before issue 64 has no stale mismatch in its summary: none is made up for it
        figures = {k: summary[k] for k in ("flip_rate", "override_rate", "logp_gap", "stale_mismatch") if k in summary}
        return {"retention": retention | figures}

    def _run(self) -> list[dict]:
        from rpb.toyworld.study.lanes import Job, run_jobs

        self.pin()
        g = self.grid
        self.probe()
        me = self if self.lanes <= 1 else dataclasses.replace(self, progress=False)
        jobs = [Job(me.inputs, label="start, prompts and prior"), Job(me.base_facts, label="base facts")]
        selection: dict[str, list[int]] = {}
        for method in sorted({a.method for a in g.arms if get_method(a.method).coefficient}):
            for weight in g.candidates[method]:
                where = self.out / "selection" / f"{method}-{weight:g}"
                trial = (where, self.post_set, self.selection_arm(method), g.seeds[0], weight, "validation", False)
                selection.setdefault(method, []).append(len(jobs))
                jobs.append(Job(me.cell, trial, (0,), f"selection {method} {weight:g}", counted=True))
        first_cell = len(jobs)
        for arm, seed in ((a, seed) for a in g.arms for seed in g.seeds):
            after = (0, *selection.get(arm.method, ()))
            jobs.append(Job(me.grid_cell, (self.post_set, arm, seed), after, f"{arm.label} seed {seed}", True))
        results = run_jobs(jobs, self.lanes)
        if selection:
            self.select_weights(_NoBar())
        return results[first_cell:]

    def report(self, results: list[dict]) -> str:
        raise RpbError(f"grid {self.grid.name!r}: its report is across its bases (rpb.toyworld.study.rl_report)")


@dataclass(frozen=True)
class RLGrid(Conduct):
    """GRPO arms from each base's ``sft`` start (``start_seed`` on ``sets[0]``, the recipe ``post``), scored like the
    other grids (``post.score_parts``); its claims, their pairs and its collapse rule are the grid module's."""

    name: str
    sets: tuple[str, ...]
    arms: tuple[RLArm, ...]
    seeds: tuple[int, ...]
    bases: tuple[int, ...]
    post: PostRecipe
    recipe: RLRecipe = field(default_factory=RLRecipe)
    start_seed: int = 42
    #: weights tried on the validation split, per weighted method (the paper's grids' candidates)
    candidates: dict[str, tuple[float, ...]] = field(default_factory=table_weights)
    #: the anchor weights are always chosen on validation (the grids' ``coefficients`` field)
    coefficients: None = None
    study: type | None = field(default=RLStudy, **UNPINNED)
    report: Callable | None = field(default=report_rl, **UNPINNED)
    #: ``collapsed(reward, loss) -> bool``: the collapse rule each cell's summary records (None: none recorded)
    collapsed: Callable[[list, list], bool] | None = field(default=None, **UNPINNED)
    #: whose recipe trained the start, in words (the report's starts table)
    start_recipe: str = field(default="the `sft` arm's recipe", **UNPINNED)
    #: the arm every other is paired with in the scores table (its label; "": the first arm)
    reference: str = field(default="", **UNPINNED)
    #: each claim's pairs for the detectable-difference table: (claim, arm, reference, figure, relative)
    claim_pairs: tuple[tuple[str, str, str, str, bool], ...] = field(default=(), **UNPINNED)
