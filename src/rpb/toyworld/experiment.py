"""``rpb experiment`` / ``rpb demo``: the paper's study in the toy world, resumable cell by cell.

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
from dataclasses import asdict, dataclass, field
from functools import cached_property
from pathlib import Path

import torch
from tqdm.auto import tqdm

from rpb.anchors import METHODS, get_method
from rpb.data import file_sha256
from rpb.errors import RpbError
from rpb.fileio import write_json_atomic, write_text_atomic
from rpb.toyworld.base import machine
from rpb.toyworld.tasks import POST_SETS, TRACE_SETS, sample
from rpb.toyworld.world import PostRecipe, ensure_base, mechanism, probe_tasks, score, train_cell, write_rows

#: the demo's fixed weight (no search, to fit its time budget): the pretraining's load-balancing weight
DEMO_COEFFICIENTS = {"lbl": 0.01}
BETAS = (0.0, 0.25, 0.5, 1.0, 2.0, 4.0)


@dataclass(frozen=True)
class Arm:
    label: str
    method: str
    anchor: tuple[tuple[str, float], ...] = ()  # fixed AnchorConfig fields besides the chosen weight
    #: beta from ``rpb calibrate``'s rule on this base, prior and data (``Study.calibrated_beta``)
    calibrated: bool = False

    @property
    def slug(self) -> str:
        return self.label.replace(" ", "").replace("=", "")


def table_weights() -> dict[str, tuple[float, ...]]:
    """The weights each weighted method of the methods table asks a grid to try."""
    return {name: m.weights for name, m in METHODS.items() if m.weights}


@dataclass(frozen=True)
class Grid:
    name: str
    sets: tuple[str, ...]
    arms: tuple[Arm, ...]
    seeds: tuple[int, ...]
    #: None: choose the weights on the validation split; else fixed weights per method
    coefficients: dict[str, float] | None = None
    tables: tuple[str, ...] = ("main",)
    #: weights tried per method on the validation split (default: the methods table's ``weights``)
    candidates: dict[str, tuple[float, ...]] = field(default_factory=table_weights)
    #: the base recipe's seeds this grid runs on: one output folder each (base<seed>/) beside the
    #: report across them; a single base runs in the output folder itself
    bases: tuple[int, ...] = (0,)
    #: the post-training and scoring recipe (None: PostRecipe(), the demo's)
    post: PostRecipe | None = None


#: the paper's methods (the controls this project adds are outside the ``full`` grid)
PAPER_METHODS = tuple(name for name, m in METHODS.items() if m.in_paper)


def _arms(*methods: str) -> tuple[Arm, ...]:
    return tuple(Arm(m, m) for m in methods)


BETA_ARMS = (*(Arm(f"rpb beta={b:g}", "rpb", (("beta", b),)) for b in BETAS), Arm("rpb hard", "rpb-hard"))
SEEDS = (42, 43, 44)
BASES = (0, 1, 2)
#: the grids' recipe: larger test sets (500 ID questions per set, 300 per pretraining domain; facts has
#: about 75 test phrasings) and every cell scored on the validation part too; the demo keeps PostRecipe()
STUDY_POST = PostRecipe(eval_id=500, eval_ood=300, score_parts=("validation", "test"))
#: the headline grid's seeds: five, as the paper's headline comparison turned out bimodal by training seed
HEADLINE_SEEDS = (42, 43, 44, 45, 46)
CALIBRATED = Arm("rpb calibrated", "rpb", calibrated=True)
#: the long-trace grid's recipe: the grids' scoring with room for a 7-line trace (at most 123 tokens)
COT_POST = dataclasses.replace(STUDY_POST, max_seq_len=128)
#: one step of a trace is one line (``rpb retention --steps-by``)
TRACE_STEPS = "\n"
GRIDS: dict[str, Grid] = {
    "headline": Grid("headline", POST_SETS, (*_arms("sft", "lbl", "rpb"), CALIBRATED), HEADLINE_SEEDS,
                     tables=("main", "mechanism"), bases=BASES, post=STUDY_POST),
    "full": Grid("full", POST_SETS, _arms(*PAPER_METHODS), SEEDS, tables=("main", "forms", "controls", "mechanism"),
                 bases=BASES, post=STUDY_POST),
    "cot": Grid("cot", TRACE_SETS, _arms("sft", "lbl", "rpb", "within-soft", "within-hard", "within-transition-soft",
                                          "within-transition-hard"), SEEDS, tables=("cot", "mechanism"), post=COT_POST),
    "small": Grid("small", ("math_post",), _arms("sft", "lbl", "rpb", "kl-to-base"), (42,), tables=("main", "forms")),
    "beta": Grid("beta", POST_SETS, BETA_ARMS, SEEDS, coefficients={}, tables=("beta", "mechanism"), bases=BASES,
                 post=STUDY_POST),
    "demo": Grid("demo", ("math_post",), (*_arms("sft", "lbl", "rpb"), CALIBRATED), (42,), DEMO_COEFFICIENTS,
                 ("demo", "mechanism")),
}  # fmt: skip


#: the transition levels a trace grid's cells keep from ``rpb retention --transitions --steps-by``
TRANSITION_KEYS = tuple(f"{level}transition_{k}" for level in ("", "step_")
                        for k in ("nmi", "tvd", "row_jsd", "communities_base"))  # fmt: skip


class GridChangedError(RpbError):
    """The output directory holds results of another set-up."""


@dataclass
class Study:
    """One output directory: its base, data, prior, and cell results."""

    out: Path
    grid: Grid
    post: PostRecipe = field(default_factory=PostRecipe)
    cache_dir: Path | None = None
    progress: bool = True
    keep_checkpoints: bool = False
    #: the seed of the base recipe (the toy world's bases 0, 1 and 2)
    base_seed: int = 0
    #: take the repository's shipped base for this recipe when the cache has none (False: pretrain it here)
    shipped: bool = True
    #: cells (and the calibration, the base's own scores) run side by side in this many processes, the usable
    #: cores shared out among them (rpb.toyworld.lanes); 1: one after another in this process
    lanes: int = 1

    def __post_init__(self):
        self.out = Path(self.out)
        if self.post.base.seed != self.base_seed:
            self.post = dataclasses.replace(self.post, base=dataclasses.replace(self.post.base, seed=self.base_seed))

    @cached_property
    def _built_base(self) -> tuple[Path, dict]:
        return ensure_base(self.post.base, self.cache_dir, self.progress, self.shipped)

    @property
    def base_record(self) -> dict:
        """The base model's pretraining record (recipe.json), building the base first if need be."""
        return self._built_base[1]

    # ------------------------------------------------------------------ set-up

    def pin(self) -> None:
        """Write grid.json, or refuse when the directory holds results of another set-up.

        The base model's weights are pinned by hash, not only its recipe: a base rebuilt on
        another machine (other GEMM blocking) or by an older version follows the same recipe
        with other weights, and a resumed grid must not mix cells of two bases.
        """
        pinned = {"grid": asdict(self.grid), "post_recipe": asdict(self.post),
                  "base_sha256": file_sha256(self.base() / "model.safetensors")}  # fmt: skip
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

    def base(self) -> Path:
        return self._built_base[0]

    def data(self, post_set: str) -> Path:
        path = self.out / "data" / f"{post_set}.train.jsonl"
        if not path.is_file():
            write_rows(sample(post_set, self.post.train_rows, seed=self.post.data_seed), path)
        return path

    @property
    def trace_set(self) -> str | None:
        """The grid's trace set (``TRACE_SETS``), if it has one: then retention is measured on its
        traces and carries the transition levels."""
        return next((s for s in self.grid.sets if s in TRACE_SETS), None)

    def probe(self) -> Path:
        path = self.out / "data" / "probe.jsonl"
        if not path.is_file():
            write_rows(probe_tasks(self.post, self.trace_set), path)
        return path

    def prior(self, post_set: str) -> Path:
        from rpb.collect import collect

        path = self.out / "priors" / f"{post_set}.safetensors"
        if not path.is_file():  # written atomically: present means complete
            collect(str(self.base()), self.data(post_set), path, top_k=self.post.base.num_experts_per_tok,
                    max_seq_len=self.post.max_seq_len, batch_size=64, progress=self.progress)  # fmt: skip
        return path

    def base_routing(self) -> dict:
        """``rpb retention`` of the base alone on the probe set: the structure post-training should keep."""
        from rpb.retention.run import run_retention

        path = self.out / "base_routing" / "report.json"
        try:
            return json.loads(path.read_text())
        except (OSError, ValueError):  # absent, or cut short by an interruption
            return run_retention(str(self.base()), self.probe(), path.parent, batch_size=64,
                                 max_seq_len=self.post.max_seq_len, progress=False)  # fmt: skip

    def calibration(self, post_set: str) -> dict:
        """``rpb calibrate`` of the base on the set's prior and data (calibration/<set>/calibrate.json),
        over the beta grid's nonzero betas: its rule gives the calibrated arm's beta."""
        from rpb.calibrate import calibrate

        path = self.out / "calibration" / post_set / "calibrate.json"
        if not path.is_file():  # written last: present means finished
            calibrate(str(self.base()), self.prior(post_set), self.data(post_set), out=path.parent,
                      betas=[b for b in BETAS if b > 0], batch_size=64, progress=self.progress)  # fmt: skip
        return json.loads(path.read_text())

    def calibrated_beta(self, post_set: str) -> float:
        return float(self.calibration(post_set)["recommended_beta"])

    def base_facts(self) -> dict:
        """The base itself: its weights' hash, held-out exact match per domain, routing structure."""
        from rpb.toyworld.world import between_domain_jsd

        path = self.out / "base_facts.json"
        if not path.is_file():
            routing = self.base_routing()["mean"]
            facts = {"seed": self.base_seed, "weights_sha256": file_sha256(self.base() / "model.safetensors"),
                     "heldout_exact_match": self.base_record["heldout_exact_match"],
                     "modularity": routing["modularity_base"], "communities": routing["communities_base"],
                     "between_domain_jsd_bits": between_domain_jsd(self.base(), self.post)}  # fmt: skip
            write_json_atomic(path, facts)
        return json.loads(path.read_text())

    def base_score(self, post_set: str) -> dict:
        """The base model's ID / OOD exact match on the test questions: where post-training starts."""
        path = self.out / "base_scores" / f"{post_set}.json"
        if not path.is_file():
            write_json_atomic(path, score(self.base(), post_set, self.post, "test"))
        return json.loads(path.read_text())

    # ------------------------------------------------------------------ cells

    def cell(self, where: Path, post_set: str, arm: Arm, seed: int, weight: float | None,
             part: str | None = None, retention: bool = True) -> dict:  # fmt: skip
        """One cell, trained and scored (on ``part``, or on every part of the recipe's ``score_parts``,
        the test part's figures on top), with its retention and mechanism figures."""
        done = where / "result.json"
        if done.is_file():
            return json.loads(done.read_text())
        shutil.rmtree(where, ignore_errors=True)  # an unfinished cell starts over
        anchor = dict(arm.anchor)
        if (fld := get_method(arm.method).coefficient) is not None:
            anchor[fld] = weight
        if arm.calibrated:
            anchor["beta"] = self.calibrated_beta(post_set)
        needs_prior = get_method(arm.method).needs_prior
        ckpt, train_s = train_cell(
            self.base(), self.data(post_set), self.prior(post_set) if needs_prior else None, where / "model",
            arm.method, seed, self.post, anchor, progress=self.progress, label=f"{post_set} {arm.label} seed {seed}",
        )  # fmt: skip
        started = time.perf_counter()
        parts = (part,) if part else self.post.score_parts
        scores = {p: score(ckpt, post_set, self.post, p) for p in parts}
        shown = scores["test"] if "test" in scores else scores[parts[0]]
        result = {"set": post_set, "arm": arm.label, "method": arm.method, "seed": seed, "base": self.base_seed,
                  "anchor": anchor, **shown, "scores": scores}  # fmt: skip
        if retention:
            from rpb.retention.run import run_retention

            traces = self.trace_set is not None
            report = run_retention(str(self.base()), self.probe(), where / "retention", post=str(ckpt),
                                   batch_size=64, max_seq_len=self.post.max_seq_len, progress=False,
                                   transitions=traces, steps_by=TRACE_STEPS if traces else None)  # fmt: skip
            keys = ("tvd", "jsd", "topk_overlap", "nmi") + (TRANSITION_KEYS if traces else ())
            result["retention"] = {k: report["mean"][k] for k in keys}
            result["mechanism"] = mechanism(self.base(), ckpt, self.prior(post_set), self.data(post_set))
        result["seconds"] = {"train": train_s, "evaluate": time.perf_counter() - started}
        # the kernels' summation order follows the intra-op thread count: a redone cell is bit-identical on the
        # same machine type with the same count (OMP_NUM_THREADS). The torch build is recorded beside them (2.11
        # and 2.13 gave the same cells on one Xeon type; another build's kernels may not)
        result["threads"], result["machine"], result["torch"] = torch.get_num_threads(), machine(), torch.__version__
        if not self.keep_checkpoints:
            shutil.rmtree(ckpt, ignore_errors=True)
        write_json_atomic(done, result)
        return result

    def select_weights(self, bar, only: str | None = None) -> dict[str, float]:
        """The anchor weight of every weighted method in the grid (fixed, or chosen on validation), recorded in
        selection.json; ``only``: that method's alone, recording nothing. A cell asks for its own method's
        weight only: another method's selection runs may still be running in another lane, and a cell that
        asked for them would start them over in the same folder."""
        methods = sorted({a.method for a in self.grid.arms if get_method(a.method).coefficient})
        if self.grid.coefficients is not None:
            missing = [m for m in methods if m not in self.grid.coefficients]
            if missing:
                raise ValueError(f"grid {self.grid.name!r} fixes no weight for {missing}")
            return {m: self.grid.coefficients[m] for m in methods}
        path = self.out / "selection.json"
        chosen, trials = {}, []
        for method in methods if only is None else [only]:
            scores = {}
            for weight in self.grid.candidates[method]:
                where = self.out / "selection" / f"{method}-{weight:g}"
                r = self.cell(where, self.grid.sets[0], Arm(method, method), self.grid.seeds[0], weight,
                              part="validation", retention=False)  # fmt: skip
                scores[weight] = (r["id"] + r["ood"]) / 2
                trials.append({"method": method, "weight": weight, "id": r["id"], "ood": r["ood"]})
                bar.update(1)
            chosen[method] = max(scores, key=lambda w: (scores[w], -w))  # ties: the weaker anchor
        if only is not None:
            return chosen
        record = {"set": self.grid.sets[0], "seed": self.grid.seeds[0], "part": "validation",
                  "criterion": "mean of ID and OOD exact match", "chosen": chosen, "trials": trials}  # fmt: skip
        if not path.is_file() or json.loads(path.read_text()) != record:
            write_json_atomic(path, record)
        return chosen

    def grid_cell(self, post_set: str, arm: Arm, seed: int) -> dict:
        """One of the grid's cells, at its arm's weight (fixed, or chosen by the finished selection runs)."""
        weight = None
        if get_method(arm.method).coefficient:
            weight = self.select_weights(_NoBar(), only=arm.method)[arm.method]
        return self.cell(self.out / "runs" / post_set / arm.slug / f"seed{seed}", post_set, arm, seed, weight)

    def run(self) -> list[dict]:
        """Every cell of the grid (finished ones are read back); returns their results."""
        with _quiet_loading():
            return self._run()

    def _run(self) -> list[dict]:
        from rpb.toyworld.lanes import Job, run_jobs

        self.pin()
        g = self.grid
        for post_set in g.sets:  # every lane reads these: written here first, once
            self.prior(post_set)
        self.probe()
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
        if g.coefficients is None:
            for method in sorted({a.method for a in g.arms if get_method(a.method).coefficient}):
                for weight in g.candidates[method]:
                    where = self.out / "selection" / f"{method}-{weight:g}"
                    trial = (where, g.sets[0], Arm(method, method), g.seeds[0], weight, "validation", False)
                    selection.setdefault(method, []).append(len(jobs))
                    jobs.append(Job(me.cell, trial, label=f"selection {method} {weight:g}", counted=True))
        first_cell = len(jobs)
        for post_set, arm, seed in ((s, a, seed) for s in g.sets for a in g.arms for seed in g.seeds):
            after = (*selection.get(arm.method, ()), *([calibration[post_set]] if arm.calibrated else []))
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

    def report(self, results: list[dict]) -> str:
        """tables.md (tables, chosen weights, base scores, figures) and results.json; returns the tables."""
        with _quiet_loading():
            return self._report(results)

    def _report(self, results: list[dict]) -> str:
        from rpb.toyworld.tables import machine_mix, paired_table, plot_retention, plot_tradeoff, table

        g = self.grid
        arms = tuple(a.label for a in g.arms)
        base_scores = {s: self.base_score(s) for s in g.sets}
        tables = "\n".join(table(kind, results, g.sets, arms, base_scores) for kind in g.tables)
        if self.trace_set:  # do static and transition retention tell one story? does a shuffle stay near rpb?
            tables += "\n" + paired_table(results, self.trace_set) + (
                f"\nOne base, {len(g.seeds)} seeds: the bootstrap resamples the seeds only, and with so few its "
                "interval is narrower than a t interval would be.\n")  # fmt: skip
        weights = self.select_weights(_NoBar()) if any(get_method(a.method).coefficient for a in g.arms) else {}
        plot_tradeoff(results, g.sets, arms, self.out / "tradeoff.png")
        plot_retention(results, g.sets, arms, self.out / "retention.png")
        base = {d: round(100 * v, 1) for d, v in self.base_record["heldout_exact_match"].items()}
        structure = self.base_routing()["mean"]
        lines = [
            f"# Toy-world study: grid `{g.name}`", "",
            f"{len(g.sets)} post-training set(s) x {len(g.arms)} arm(s) x {len(g.seeds)} seed(s) "
            f"{list(g.seeds)}; {self.post.max_steps} steps of batch {self.post.batch_size} on "
            f"{self.post.train_rows} rows; ID = the set's held-out test questions ({self.post.eval_id}), OOD = mean "
            f"over the pretraining domains' held-out test questions ({self.post.eval_ood} per domain at most); "
            "retention on the probe set against the base.", "",
            tables,
            machine_mix(results), "",
            "Anchor weights: " + (", ".join(f"{m} {w:g}" for m, w in sorted(weights.items())) or "none") + (
                " (fixed)" if g.coefficients is not None else " (chosen on the validation split: selection.json)"),
            *(["Calibrated beta (`rpb calibrate`'s rule, rpb/calibrate/rule.py): "
               + ", ".join(f"{s} {self.calibrated_beta(s):g}" for s in g.sets) + " (calibration/<set>/calibrate.md)"]
              if any(a.calibrated for a in g.arms) else []),
            "", f"Base model held-out exact match % (pretraining's own evaluation): {base}", "",
            f"Base routing on the probe set (mean over MoE layers): utilization entropy "
            f"{structure['entropy_base_bits']:.3f} bits, {structure['communities_base']:.1f} Louvain communities, "
            f"modularity {structure['modularity_base']:.3f} (base_routing/report.md)", "",
            "![ID vs OOD](tradeoff.png)", "", "![retention](retention.png)", "",
        ]  # fmt: skip
        text = "\n".join(lines)
        write_text_atomic(self.out / "tables.md", text)
        write_json_atomic(self.out / "results.json", sorted(results, key=lambda r: (r["set"], r["arm"], r["seed"])))
        return tables


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
