"""One base of a grid (``Study``): the paper's study in the toy world, resumable cell by cell.

A grid is (post-training sets) x (arms) x (seeds). An *arm* is a method with its settings (the
beta grid has one arm per beta). Every finished cell writes ``result.json`` last, atomically; a
rerun of the same command skips finished cells and redoes unfinished ones from scratch, and the
tables are made from the result files alone, so an interrupted and an uninterrupted run give the
same tables. ``grid.json`` pins what the results depend on; a rerun that would change it is
refused.

Anchor weights (``lambda``, ``lbl_coef``) are chosen once per output directory, before the grid:
each candidate trains on the first post-training set with the first seed and is scored on the
*validation* half of the held-out questions (mean of ID and OOD); the tables use the *test*
half. The choice is recorded in ``selection.json`` and printed under the tables.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import shutil
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import ClassVar

import torch
from tqdm.auto import tqdm

from rpb.anchors import get_method
from rpb.data import file_sha256
from rpb.errors import RpbError
from rpb.fileio import write_json_atomic
from rpb.toyworld.study.grid import Arm, pinned_fields
from rpb.toyworld.study.inputs import StudyInputs
from rpb.toyworld.study.report import write_report
from rpb.toyworld.world.base import machine
from rpb.toyworld.world.post import mechanism, score, train_cell
from rpb.toyworld.world.tasks import TRACE_STEPS


class GridChangedError(RpbError):
    """The output directory holds results of another set-up."""


#: the transition levels a trace set's cells keep from ``rpb retention --transitions --steps-by``
TRANSITION_KEYS = tuple(
    f"{level}transition_{k}" for level in ("", "step_") for k in ("nmi", "tvd", "row_jsd", "communities_base")
)


@dataclass
class Study(StudyInputs):
    """One output directory: its inputs (``StudyInputs``), its pinned set-up, and its cells' results."""

    #: what a base of this kind ships besides ``study.shipping.SHIPPED_FILES`` (glob patterns under its folder)
    ships: ClassVar[tuple[str, ...]] = ()

    # ------------------------------------------------------------------ set-up

    def pin(self) -> None:
        """Write grid.json, or refuse when the directory holds results of another set-up.

        The base model's weights are pinned by hash, not only its recipe: a base rebuilt on
        another machine (other GEMM blocking) or by an older version follows the same recipe
        with other weights, and a resumed grid must not mix cells of two bases.
        """
        pinned = {
            "grid": pinned_fields(self.grid),
            "post_recipe": asdict(self.post),
            "base_sha256": file_sha256(self.base() / "model.safetensors"),
        }
        path = self.out / "grid.json"
        if path.is_file():
            old = json.loads(path.read_text())
            if old != json.loads(json.dumps(pinned)):
                changed = sorted(k for k in pinned if old.get(k) != json.loads(json.dumps(pinned[k])))
                changed = [f"{k} (the base model's weights)" if k == "base_sha256" else k for k in changed]
                raise GridChangedError(
                    f"{path}: this directory holds results of another set-up (differs in: {', '.join(changed)}); "
                    "use a new --out, or delete it to start over"
                )
            return
        write_json_atomic(path, pinned)

    # ------------------------------------------------------------------ cells

    def cell(
        self,
        where: Path,
        post_set: str,
        arm: Arm,
        seed: int,
        weight: float | None,
        part: str | None = None,
        retention: bool = True,
    ) -> dict:
        """One cell, trained (``train``) and scored (on ``part``, or on every part of the recipe's ``score_parts``,
        the test part's figures on top), with its routing figures (``measure``)."""
        done = where / "result.json"
        if done.is_file():
            return json.loads(done.read_text())
        shutil.rmtree(where, ignore_errors=True)  # an unfinished cell starts over
        anchor = dict(arm.anchor)
        if (fld := get_method(arm.method).coefficient) is not None:
            anchor[fld] = weight
        if arm.calibrated:
            anchor["beta"] = self.calibrated_beta(post_set)
        ckpt, train_s, trained = self.train(where, post_set, arm, seed, anchor)
        started = time.perf_counter()
        parts = (part,) if part else self.post.score_parts
        scores = {p: score(ckpt, post_set, self.post, p) for p in parts}
        shown = scores["test"] if "test" in scores else scores[parts[0]]
        result = {
            "set": post_set,
            "arm": arm.label,
            "method": arm.method,
            "seed": seed,
            "base": self.base_seed,
            "anchor": anchor,
            **shown,
            "scores": scores,
            **trained,
        }
        if retention:
            result |= self.measure(where, ckpt, post_set, result)
        result["seconds"] = {"train": train_s, "evaluate": time.perf_counter() - started}
        # the kernels' summation order follows the intra-op thread count: a redone cell is bit-identical on the
        # same machine type with the same count (OMP_NUM_THREADS). The torch build is recorded beside them (2.11
        # and 2.13 gave the same cells on one Xeon type; another build's kernels may not)
        result["threads"], result["machine"], result["torch"] = torch.get_num_threads(), machine(), torch.__version__
        if not self.keep_checkpoints:
            shutil.rmtree(ckpt, ignore_errors=True)
        write_json_atomic(done, result)
        return result

    def train(self, where: Path, post_set: str, arm: Arm, seed: int, anchor: dict) -> tuple[Path, float, dict]:
        """Train one cell into ``where``: its checkpoint, the training seconds, and what the cell's record adds
        (the prior's kind where it is not the probability prior; ``rpb train`` keeps its own log beside the
        checkpoint)."""
        needs_prior = get_method(arm.method).needs_prior
        ckpt, train_s = train_cell(
            self.base(),
            self.data(post_set),
            self.prior(post_set, arm.prior_kind) if needs_prior else None,
            where / "model",
            arm.method,
            seed,
            self.post,
            anchor,
            progress=self.progress,
            label=f"{post_set} {arm.label} seed {seed}",
        )
        return ckpt, train_s, {} if arm.prior_kind == "probability" else {"prior_kind": arm.prior_kind}

    def measure(self, where: Path, ckpt: Path, post_set: str, result: dict) -> dict:
        """A trained cell's routing figures: its retention against the base on the probe set, and the mechanism
        (what the bias did to the routing)."""
        from rpb.retention.run import run_retention

        traces = self.trace_set is not None
        report = run_retention(
            str(self.base()),
            self.probe(),
            where / "retention",
            post=str(ckpt),
            batch_size=64,
            max_seq_len=self.post.max_seq_len,
            progress=False,
            transitions=traces,
            steps_by=TRACE_STEPS if traces else None,
        )
        keys = ("tvd", "jsd", "topk_overlap", "nmi") + (TRANSITION_KEYS if traces else ())
        return {
            "retention": {k: report["mean"][k] for k in keys},
            "mechanism": mechanism(
                self.base(), ckpt, self.prior(post_set, result.get("prior_kind", "probability")), self.data(post_set)
            ),
        }

    def selection_key(self, arm: Arm) -> str | None:
        """Which selection gives ``arm`` its weight (None: the arm has none): its method's, unless a study tells
        two arms of one method apart (another base, other data)."""
        return arm.method if get_method(arm.method).coefficient else None

    def selection_keys(self) -> list[str]:
        """The selections the grid's arms read, in order; those ``grid.coefficients`` fixes are not chosen."""
        return sorted({k for a in self.grid.arms if (k := self.selection_key(a)) is not None})

    def selected_keys(self) -> list[str]:
        """The selections chosen on validation: all (no ``grid.coefficients``), or, where the grid says it
        ``selects_unfixed``, those its coefficients do not fix."""
        fixed = self.grid.coefficients
        if fixed is None:
            return self.selection_keys()
        return [k for k in self.selection_keys() if k not in fixed] if self.grid.selects_unfixed else []

    def select_weights(self, bar, only: str | None = None) -> dict[str, float]:
        """The anchor weight of every selection the grid reads (fixed, or chosen on validation), recorded in
        selection.json; ``only``: that selection's alone, recording nothing. A cell asks for its own selection
        only: another one's runs may still be running in another lane, and a cell that asked for them would start
        them over in the same folder. A grid fixes every weight (``coefficients``), or none, or (a grid of its
        own kind) some, choosing the others among its ``candidates``."""
        keys = self.selection_keys()
        fixed = dict(self.grid.coefficients or {})
        chosen_here = self.selected_keys()
        missing = [k for k in keys if k not in fixed and k not in chosen_here]
        if missing:
            raise ValueError(f"grid {self.grid.name!r} fixes no weight for {missing}")
        if not chosen_here:
            return {k: fixed[k] for k in keys if only in (None, k)}
        path = self.out / "selection.json"
        chosen, trials = {}, []
        for key in chosen_here if only is None else [k for k in chosen_here if k == only]:
            scores = {}
            for weight in self.grid.candidates[key]:
                where = self.out / "selection" / f"{key}-{weight:g}"
                r = self.cell(
                    where,
                    self.grid.sets[0],
                    self.selection_arm(key),
                    self.grid.seeds[0],
                    weight,
                    part="validation",
                    retention=False,
                )
                scores[weight] = (r["id"] + r["ood"]) / 2
                trials.append({"method": key, "weight": weight, "id": r["id"], "ood": r["ood"]})
                bar.update(1)
            chosen[key] = max(scores, key=lambda w: (scores[w], -w))  # ties: the weaker anchor
        if only is not None:
            return chosen or {only: fixed[only]}
        record = {
            "set": self.grid.sets[0],
            "seed": self.grid.seeds[0],
            "part": "validation",
            "criterion": "mean of ID and OOD exact match",
            "chosen": chosen,
            "trials": trials,
        }
        if not path.is_file() or json.loads(path.read_text()) != record:
            write_json_atomic(path, record)
        return {k: fixed[k] for k in keys if k in fixed} | chosen

    def selection_arm(self, key: str) -> Arm:
        """The arm a selection's runs train (the method alone)."""
        return Arm(key, key)

    def grid_cell(self, post_set: str, arm: Arm, seed: int) -> dict:
        """One of the grid's cells, at its arm's weight (fixed, or chosen by the finished selection runs)."""
        weight = None
        if (key := self.selection_key(arm)) is not None:
            weight = self.select_weights(_NoBar(), only=key)[key]
        return self.cell(self.out / "runs" / post_set / arm.slug / f"seed{seed}", post_set, arm, seed, weight)

    def run(self) -> list[dict]:
        """Every cell of the grid (finished ones are read back); returns their results."""
        with _quiet_loading():
            return self._run()

    def _run(self) -> list[dict]:
        from rpb.toyworld.study.lanes import Job, run_jobs

        self.pin()
        g = self.grid
        for post_set in g.sets:  # every lane reads these: written here first, once
            for kind in sorted({a.prior_kind for a in g.arms}):
                self.prior(post_set, kind)
        self.probe()
        self.prepare()
        me = self if self.lanes <= 1 else dataclasses.replace(self, progress=False)  # no bars from the lanes
        jobs = [
            Job(me.base_routing, label="base routing"),
            *(Job(me.base_score, (s,), label=f"base {s}") for s in g.sets),
        ]
        calibration = {}
        if any(a.calibrated for a in g.arms):
            for post_set in g.sets:
                calibration[post_set] = len(jobs)
                jobs.append(Job(me.calibration, (post_set,), label=f"calibration {post_set}"))
        selection: dict[str, list[int]] = {}
        for key in self.selected_keys():
            for weight in g.candidates[key]:
                where = self.out / "selection" / f"{key}-{weight:g}"
                trial = (where, g.sets[0], self.selection_arm(key), g.seeds[0], weight, "validation", False)
                selection.setdefault(key, []).append(len(jobs))
                jobs.append(Job(me.cell, trial, label=f"selection {key} {weight:g}", counted=True))
        jobs += self.more_jobs(me)
        first_cell = len(jobs)
        for post_set, arm, seed in ((s, a, seed) for s in g.sets for a in g.arms for seed in g.seeds):
            key = self.selection_key(arm)
            after = (*selection.get(key, ()), *([calibration[post_set]] if arm.calibrated else []))
            jobs.append(Job(me.grid_cell, (post_set, arm, seed), after, f"{post_set} {arm.label} seed {seed}", True))
        bar = tqdm(total=sum(j.counted for j in jobs), unit="run", desc=f"grid {g.name}", disable=not self.progress)

        def finished(job: Job) -> None:
            if job.counted:
                bar.set_postfix_str(job.label)
                bar.update(1)

        results = run_jobs(jobs, self.lanes, finished)
        bar.close()
        if selection:  # every selection run finished: the record of all of them
            self.select_weights(_NoBar())
        return results[first_cell:]

    def prepare(self) -> None:
        """What every lane of a study kind reads besides the priors and the probe set, made once before the jobs
        (nothing here)."""

    def more_jobs(self, me: Study) -> list:
        """Jobs a study kind runs beside the grid's cells (``lanes.Job``, after nothing; none here)."""
        return []

    def report(self, results: list[dict]) -> str:
        """tables.md (tables, chosen weights, base scores, figures) and results.json; returns the tables."""
        needs_weights = bool(self.selection_keys())
        weights = self.select_weights(_NoBar()) if needs_weights else {}
        with _quiet_loading():
            return write_report(self, results, weights)


@contextlib.contextmanager
def _quiet_loading():
    """transformers' per-file load/save bars would bury the grid's own."""
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()
    try:
        yield
    finally:
        hf_logging.enable_progress_bar()


class _NoBar:
    def update(self, n: int) -> None:
        pass


def cell_paths(st: Study) -> list[Path]:
    """Every result file a base of the grid owes: its cells in the grid's order, then its selection runs."""
    g = st.grid
    cells = [
        st.out / "runs" / s / a.slug / f"seed{seed}" / "result.json" for s in g.sets for a in g.arms for seed in g.seeds
    ]
    cells += [st.out / "selection" / f"{k}-{w:g}" / "result.json" for k in st.selected_keys() for w in g.candidates[k]]
    return cells
