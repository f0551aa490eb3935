"""``hold-stored``: stored routes that hold like the base itself? ``routing-kd`` from route files whose terms are 0 at
the base (``anchor.routes_loss``: ``bucket``, ``hinge``) against the online base, and two controls for why
``routing-kd`` works, on the ``hold`` grid's recipe, data, bases and scoring.

Arms, on math_post and code_post x 3 bases x 3 seeds:

* ``stored top-k``: the base's probabilities at its routed k stored (``rpb routes --with-probs --top-m k``), the
  bucket form (the coarsened KL, 0 at the base);
* ``stored top-2k``: the same with the next k experts stored too (``--top-m 2k``);
* ``stored ids hinge``: ids alone (``rpb routes``, as an engine returns them), the hinge on the family's selection
  scores (0 wherever the model's own rule returns the base's set);
* ``routing-kd-router``: online ``routing-kd`` with the router's input detached (gradient to the routers alone);
* ``hidden-kd``: the hidden state entering each MoE router held to the base's (online);
* copied: ``sft`` and ``routing-kd`` (online, at the ``hold`` grid's λ per base, ``HOLD_LAMBDA``) from the
  ``hold-target`` grid, ``routing-kd routes`` (the ``hold`` grid's stored ids under the set cross-entropy) from the
  ``hold`` grid, each result file byte for byte where the repository ships that grid's base with the same pinned
  base weights and recipe (trained here where it does not).

Why ``sft`` and online ``routing-kd`` come from ``hold-target`` and not from ``hold``: the new arms run on this
machine type (AMD EPYC, one thread); the ``hold`` grid's online cells ran on an Intel Xeon, and ``hold-target``
found cells of one recipe differ across the two machine types by up to 2.0 points, the size of a margin.
``hold-target``'s ``sft`` and fixed-λ ``routing-kd`` cells are the ``hold`` grid's recipe, data and λ retrained on
AMD EPYC. The set cross-entropy arm has no AMD EPYC copy: its cells are the ``hold`` grid's (Xeon), and claims 2
and 3 compare across the two machine types (stated in the report beside their verdicts; the ``hold`` grid measured
that arm 15 points below online, far beyond a 2-point machine spread).

Weights: each new arm's λ is chosen per base on validation as the ``hold`` grid chose (the first set, the first
seed, mean of ID and OOD exact match) among ``WEIGHTS``; the set cross-entropy arm's selection is the ``hold``
grid's four runs (0.01 to 10, copied) and one at λ 100 trained here, so every compared stored arm had the same
candidates; where 100 wins on a base, that base's set cross-entropy cells are trained here at 100 instead of
copied. A choice at either end of the range is flagged in the report, and nothing more is tried.

The claims (``judge_hold_stored``) and their margins were fixed before the grid's first cell (this module's first
commit), judged with the grids' two-stage bootstrap over the bases and their seeds and Holm across the family:

1a. ``stored top-k`` ≈ online ``routing-kd`` in top-k overlap (probe set): within ±``OVERLAP_MARGIN`` (two one-sided
    tests; the ``hold`` grid's paired SD of stored − online overlap: 0.044 on math_post, 0.060 on code_post);
1b. ``stored top-k`` − online OOD > −``OOD_MARGIN[set]`` points: the ``hold`` grid's paired SD of stored − online
    OOD, rounded up to 0.1 point (4.496 and 8.146, so 4.5 and 8.2); the minimal detectable difference of 9 such
    pairs (two-sided paired t, α 0.05, power 0.8) is 4.8 and 8.7 points;
2.  ``stored top-k`` keeps OOD better than the ``hold`` grid's stored ids (``routing-kd routes``);
3.  ``stored ids hinge`` keeps OOD better than the set cross-entropy (``routing-kd routes``);
4.  ``routing-kd-router`` keeps less OOD than online ``routing-kd``.

Outside Holm, reported either way: (5) ``hidden-kd`` against online ``routing-kd`` out of domain; (6) ``stored
top-2k`` against ``stored top-k`` out of domain.
"""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass
from functools import partial
from pathlib import Path

from rpb.toyworld.grids.hold import ROUTES_SELECTION, STORED_ANCHOR
from rpb.toyworld.grids.hold_target import HOLD_LAMBDA
from rpb.toyworld.study.cells import Study, _NoBar
from rpb.toyworld.study.grid import BASES, SEEDS, STUDY_POST, Arm, Grid
from rpb.toyworld.study.paired import SHIPPED_RESULTS, copy_cell, shipped_base
from rpb.toyworld.study.stats import Verdict, equivalent, greater, holm_beside, judge_paired, threshold_above
from rpb.toyworld.world.generators import POST_SETS

#: the weights every selection of this grid tries (the ``hold`` grid's, and 100)
WEIGHTS = (0.01, 0.1, 1.0, 10.0, 100.0)
#: claim 1a: the overlap margin of ``stored top-k`` against online ``routing-kd`` (module doc)
OVERLAP_MARGIN = 0.05
#: claim 1b: the non-inferiority margin of ``stored top-k`` against online ``routing-kd``, OOD points (module doc)
OOD_MARGIN = {"math_post": 4.5, "code_post": 8.2}
#: what a weighted cell keeps of its training log, per logging window (``windows``): its term (coefficient applied),
#: and the share of tokens where the ids-alone hinge is active (a null result of the hinge is read with it)
WINDOW_KEYS = ("moe/mean/anchor_loss", "moe/mean/routes_hinge_active")
#: the route files the stored arms read: ids alone, or the probabilities at the top M (None: ids alone; "k" and
#: "2k" in units of the model's top-k)
ROUTE_FORMS = {"ids": None, "top-k": 1, "top-2k": 2}


@dataclass(frozen=True)
class StoredArm(Arm):
    """An arm of the ``hold-stored`` grid: ``routes`` the route file it reads (``ROUTE_FORMS``; None: online);
    ``selection`` its weight's selection; ``source`` the shipped grid its cells are copied from (None: trained
    here)."""

    routes: str | None = None
    selection: str | None = None
    source: str | None = None


def _stored(loss: str) -> tuple[tuple[str, str], ...]:
    """A stored-routes anchor under the term ``loss`` (``anchor.routes_loss``); the route file's path is the run's."""
    return (("base", "routes"), ("routes_loss", loss))


# fmt: skip below: one arm a row, its label, method, anchor, route file, selection and source side by side
STORED_ARMS = (
    StoredArm("sft", "sft", source="hold-target"),
    StoredArm("routing-kd", "routing-kd", source="hold-target"),
    StoredArm("routing-kd routes", "routing-kd", STORED_ANCHOR, routes="ids", selection=ROUTES_SELECTION,
              source="hold"),
    StoredArm("stored top-k", "routing-kd", _stored("bucket"), routes="top-k", selection="stored-top-k"),
    StoredArm("stored top-2k", "routing-kd", _stored("bucket"), routes="top-2k", selection="stored-top-2k"),
    StoredArm("stored ids hinge", "routing-kd", _stored("hinge"), routes="ids", selection="stored-ids-hinge"),
    StoredArm("routing-kd-router", "routing-kd-router", selection="routing-kd-router"),
    StoredArm("hidden-kd", "hidden-kd", selection="hidden-kd"),
)  # fmt: skip
#: the selection each weighted arm reads, and the arm its runs train
SELECTIONS = {a.selection: a for a in STORED_ARMS if a.selection is not None}


def windows(log_jsonl: Path) -> dict:
    """The cell's ``WINDOW_KEYS`` per logging window of ``rpb train``'s log (None where a window lacks one)."""
    out: dict[str, list] = {"step": [], **{k.rsplit("/", 1)[1]: [] for k in WINDOW_KEYS}}
    for line in log_jsonl.read_text().splitlines():
        record = json.loads(line)
        if not any(k in record for k in WINDOW_KEYS):
            continue
        out["step"].append(record.get("step"))
        for k in WINDOW_KEYS:
            out[k.rsplit("/", 1)[1]].append(record.get(k))
    return out


@dataclasses.dataclass
class HoldStoredStudy(Study):
    """One base of the ``hold-stored`` grid (module doc); ``shipped_results``: where the copied grids are."""

    shipped_results: Path = SHIPPED_RESULTS

    def selection_key(self, arm: Arm) -> str | None:
        return getattr(arm, "selection", None)  # online routing-kd reads the hold grid's λ (HOLD_LAMBDA)

    def selection_arm(self, key: str) -> Arm:
        # labelled by the selection, as the hold grid's selection runs are (the copied ones among them)
        return dataclasses.replace(SELECTIONS[key], label=key)

    # ------------------------------------------------------------------ copies

    def shipped_base(self, grid: str) -> Path | None:
        """``grid``'s shipped folder of this base, if it pins the same base weights and recipe as this one."""
        return shipped_base(self, self.shipped_results, grid)

    def copied_choice(self) -> float | None:
        """The ``hold`` grid's choice for the set cross-entropy on this base (None: it ships no selection here)."""
        hold = self.shipped_base("hold")
        record = hold / "selection.json" if hold is not None else None
        return json.loads(record.read_text())["chosen"][ROUTES_SELECTION] if record and record.is_file() else None

    def chosen_routes_weight(self) -> float:
        """The set cross-entropy's λ on this base: the best of the copied selection runs and the one at 100."""
        return self.select_weights(_NoBar(), only=ROUTES_SELECTION)[ROUTES_SELECTION]

    def prepare(self) -> None:
        # the set cross-entropy's selection runs the hold grid ran, copied: present means finished (Study.cell)
        if (hold := self.shipped_base("hold")) is not None:
            for weight in WEIGHTS:
                where = f"{ROUTES_SELECTION}-{weight:g}"
                copy_cell(hold / "selection" / where / "result.json", self.out / "selection" / where / "result.json")
        for post_set in self.grid.sets:
            for form in sorted({a.routes for a in self.grid.arms if a.routes is not None}):
                self.routes(post_set, form)

    def copy_source(self, post_set: str, arm: Arm) -> Path | None:
        """The shipped cells this arm's are copies of (None: trained here): its source grid's arm folder on this
        base where that grid pins the same set-up; the set cross-entropy's only at the ``hold`` grid's own choice
        of λ (a base where λ 100 wins trains them here)."""
        source = getattr(arm, "source", None)
        if source is None or (shipped := self.shipped_base(source)) is None:
            return None
        if arm.label == "routing-kd routes" and self.chosen_routes_weight() != self.copied_choice():
            return None
        return shipped / "runs" / post_set / arm.slug

    def grid_cell(self, post_set: str, arm: Arm, seed: int) -> dict:
        where = self.out / "runs" / post_set / arm.slug / f"seed{seed}"
        if (source := self.copy_source(post_set, arm)) is not None:
            copy_cell(source / f"seed{seed}" / "result.json", where / "result.json")
        if arm.label == "routing-kd":  # online, at the hold grid's λ on this base (copied or not)
            return self.cell(where, post_set, arm, seed, HOLD_LAMBDA[self.base_seed])
        return super().grid_cell(post_set, arm, seed)

    # ------------------------------------------------------------------ cells

    def routes(self, post_set: str, form: str) -> Path:
        """The base's routes over the set's training rows, in ``form`` (``ROUTE_FORMS``); written atomically, so
        present means complete. The probabilities are read under the grids' router transform, the runs' own."""
        from rpb.collect.hf_routes import write_routes
        from rpb.toyworld.world.post import ROUTER_TRANSFORM

        path = self.out / "routes" / f"{post_set}-{form}.safetensors"
        if not path.is_file():
            times = ROUTE_FORMS[form]
            top_m = None if times is None else times * self.post.base.num_experts_per_tok
            write_routes(
                str(self.base()),
                self.data(post_set),
                path,
                self.post.max_seq_len,
                batch_size=64,
                probs_transform=None if top_m is None else ROUTER_TRANSFORM,
                top_m=top_m,
            )
        return path

    def train(self, where: Path, post_set: str, arm: Arm, seed: int, anchor: dict):
        form = getattr(arm, "routes", None)
        if form is None:
            return super().train(where, post_set, arm, seed, anchor)
        # the route file's path is this run folder's: in the run's anchor, not in the cell's record
        return super().train(where, post_set, arm, seed, anchor | {"routes": str(self.routes(post_set, form))})

    def measure(self, where: Path, ckpt: Path, post_set: str, result: dict) -> dict:
        figures = super().measure(where, ckpt, post_set, result)
        if result["method"] != "sft":
            figures["windows"] = windows(ckpt / "log.jsonl")
        return figures


def judge_hold_stored(results: list[dict], sets: tuple[str, ...]) -> list[Verdict]:
    """The grid's claims (module doc) on every set, Holm across 1a-4; 5 and 6 after them, unadjusted."""
    family: list[Verdict] = []
    outside: list[Verdict] = []
    judged = partial(judge_paired, results)
    for s in sets:
        # fmt: skip below: one claim a row, its rule, arms, metric and margin side by side
        family += [
            judged(equivalent, f"(1a) stored top-k ≈ online, overlap ±{OVERLAP_MARGIN:g} ({s})",
                   "stored top-k", "routing-kd", s, "topk_overlap", OVERLAP_MARGIN),
            judged(threshold_above, f"(1b) stored top-k − online > −{OOD_MARGIN[s]:g} points ({s}, OOD)",
                   "stored top-k", "routing-kd", s, "ood", -OOD_MARGIN[s]),
            judged(greater, f"(2) stored top-k > stored ids, set-ce ({s}, OOD)",
                   "stored top-k", "routing-kd routes", s, "ood", 1),
            judged(greater, f"(3) stored ids hinge > stored ids, set-ce ({s}, OOD)",
                   "stored ids hinge", "routing-kd routes", s, "ood", 1),
            judged(greater, f"(4) routing-kd-router < routing-kd online ({s}, OOD)",
                   "routing-kd-router", "routing-kd", s, "ood", -1),
        ]  # fmt: skip
        # fmt: skip below: the same, for the two reported outside the family
        outside += [
            judged(greater, f"(5) hidden-kd vs routing-kd online ({s}, OOD)", "hidden-kd", "routing-kd", s, "ood", 1),
            judged(greater, f"(6) stored top-2k vs stored top-k ({s}, OOD)", "stored top-2k", "stored top-k", s,
                   "ood", 1),
        ]  # fmt: skip
    return holm_beside(family, outside)


def report_hold_stored(grid, studies: list, results: list[dict], out: Path) -> str:
    """The report across the bases (``rpb.toyworld.grids.hold_stored_report``)."""
    from rpb.toyworld.grids.hold_stored_report import write_hold_stored_report

    return write_hold_stored_report(grid, studies, results, out, judge_hold_stored, OVERLAP_MARGIN, OOD_MARGIN)


GRID = Grid(
    "hold-stored",
    POST_SETS,
    STORED_ARMS,
    SEEDS,
    coefficients={},
    candidates={key: WEIGHTS for key in SELECTIONS},
    bases=BASES,
    post=STUDY_POST,
    about="routing-kd from route files whose terms are 0 at the base, against the online base; two controls",
    study=HoldStoredStudy,
    report=report_hold_stored,
    claims=judge_hold_stored,
    selects_unfixed=True,
)
