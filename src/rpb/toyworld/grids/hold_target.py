"""``hold-target``: ``routing-kd`` held to a routing target (``anchor.target``) instead of a fixed λ, on the ``hold``
grid's recipe, data, bases and scoring.

Arms, on math_post and code_post x 3 bases x 3 seeds, every cell trained here (none copied: cells copied from
another machine type differ from retrained ones by up to 2.0 points, the size of a margin):

* ``sft``, and ``routing-kd`` at the fixed λ the ``hold`` grid chose per base on validation (``HOLD_LAMBDA``, from
  its ``base*/selection.json``);
* ``target 0.70``, ``target 0.80``, ``target 0.90``: ``routing-kd`` with ``anchor.target`` (the controller's
  defaults, λ₀ = 1), the step's overlap m with the base's own top-k held at that value;
* ``target matched``: the target per (base, set) is the mean ``mechanism.overlap_base`` of the ``hold`` grid's
  fixed-λ ``routing-kd`` cells there (``MATCHED``): the same routing, reached by a target instead of a λ;
* on base 0 only, ``target 0.80`` under the normalised-sigmoid router transform (``SIGMOID_ARM``; the grids pin
  softmax, ``rpb train``'s default on a DeepSeek-V3-class model is the normalised sigmoid), outside the grid's
  cells (``sigmoid/<set>/seed<k>/``).

Each cell records its λ trajectory and m per logging window (``hold``: from its ``log.jsonl``).

The claims (``judge_hold_target``) and their margins were fixed before the grid's first cell (this module's first
commit), judged with the grids' two-stage bootstrap over the bases and their seeds and Holm across the family:

2. a tighter target keeps more out of domain: OOD exact match at ``target 0.90`` − at ``target 0.70`` > 0, per set;
3. a target does what the λ did: ``target matched`` − ``routing-kd`` (fixed λ) OOD > −``OOD_MARGIN[set]``;
4. the loosest target costs little in domain: ``target 0.70`` − ``sft`` ID > −``ID_MARGIN[set]``.

The margins are the minimal detectable differences of the ``hold`` grid's own pairs (``routing-kd`` − ``sft``; a
two-sided paired t at α 0.05 and power 0.8 with 9 pairs, ``stats.minimal_detectable_difference``): the smallest
difference these cells can resolve, rounded up to 0.1 point. OOD: paired SD 5.21 (math_post) and 9.53
(code_post) points, so 5.6 and 10.2; ID: 11.39 and 1.99, so 12.2 and 2.2. math_post's in-domain pairs are too
noisy to resolve ±2 points (a margin of 12.2 says only that a large cost would be seen).

Outside Holm, reported whatever they show: (1) the acceptance check, per cell: the mean m over the last 20% of the
steps within ±``ACCEPT_BAND`` of the target, every cell listed, cells that sat at λ_max named; (5) base 0, the
normalised sigmoid against softmax at 0.80: probe-set overlap and OOD per seed, λ trajectories side by side.
"""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass
from pathlib import Path

from rpb.toyworld.study.cells import Study
from rpb.toyworld.study.grid import BASES, SEEDS, STUDY_POST, Arm, Grid
from rpb.toyworld.study.stats import Verdict, greater, holm, judge_paired, threshold_above
from rpb.toyworld.world.generators import POST_SETS

#: the ``hold`` grid's fixed λ for ``routing-kd``, chosen per base on validation (its base*/selection.json)
HOLD_LAMBDA = {0: 10.0, 1: 10.0, 2: 1.0}
#: ``target matched``: the ``hold`` grid's fixed-λ ``routing-kd`` cells' mean ``mechanism.overlap_base``, per
#: (base, set) (docs/results/hold/results.json; three seeds each)
MATCHED = {
    (0, "math_post"): 0.887,
    (1, "math_post"): 0.908,
    (2, "math_post"): 0.803,
    (0, "code_post"): 0.941,
    (1, "code_post"): 0.942,
    (2, "code_post"): 0.880,
}
#: claim 3: non-inferiority margin of ``target matched`` against the fixed λ, OOD points (module doc)
OOD_MARGIN = {"math_post": 5.6, "code_post": 10.2}
#: claim 4: non-inferiority margin of ``target 0.70`` against ``sft``, ID points (module doc)
ID_MARGIN = {"math_post": 12.2, "code_post": 2.2}
#: claim 1 (acceptance): the band around the target the last 20% of a cell's steps' mean m must lie in
ACCEPT_BAND = 0.03
#: the share of the steps, at the end, the acceptance check averages over
ACCEPT_TAIL = 0.2
#: the targets of the grid's fixed-value arms
TARGETS = (0.70, 0.80, 0.90)
#: the transform of the base-0 control (``anchor.router_transform``)
SIGMOID = "sigmoid-normalized"


@dataclass(frozen=True)
class TargetArm(Arm):
    """An arm of the ``hold-target`` grid: ``fixed`` reads the ``hold`` grid's λ of the base; ``matched`` holds the
    target ``MATCHED`` gives its base and set (a fixed target is in ``anchor``)."""

    fixed: bool = False
    matched: bool = False


TARGET_ARMS = (
    TargetArm("sft", "sft"),
    TargetArm("routing-kd", "routing-kd", fixed=True),
    *(TargetArm(f"target {t:.2f}", "routing-kd", (("target", t),)) for t in TARGETS),
    TargetArm("target matched", "routing-kd", matched=True),
)
#: base 0's control: target 0.80 under the normalised sigmoid
SIGMOID_ARM = TargetArm("target 0.80 sigmoid", "routing-kd", (("target", 0.80), ("router_transform", SIGMOID)))


def trajectory(log_jsonl: Path) -> dict:
    """The cell's hold per logging window from ``rpb train``'s log: the step, the mean m of the window's steps, the
    worst layer's, and λ as the next step uses it (None where the run logged none: ``sft``)."""
    out: dict[str, list] = {"step": [], "overlap": [], "overlap_min": [], "lambda": []}
    for line in log_jsonl.read_text().splitlines():
        record = json.loads(line)
        if "anchor/overlap" not in record:
            continue
        out["step"].append(record.get("step"))
        out["overlap"].append(record["anchor/overlap"])
        out["overlap_min"].append(record.get("anchor/overlap_min"))
        out["lambda"].append(record.get("anchor/lambda"))
    return out


@dataclasses.dataclass
class HoldTargetStudy(Study):
    """One base of the ``hold-target`` grid (module doc)."""

    #: the base-0 control's cells
    ships = ("sigmoid/*/*/result.json",)

    def selection_key(self, arm: Arm) -> str | None:
        return None  # no weight is chosen here: the fixed λ is the hold grid's, the others steer their own

    def grid_cell(self, post_set: str, arm: Arm, seed: int) -> dict:
        weight = HOLD_LAMBDA[self.base_seed] if getattr(arm, "fixed", False) else None
        return self.cell(self.out / "runs" / post_set / arm.slug / f"seed{seed}", post_set, arm, seed, weight)

    def train(self, where: Path, post_set: str, arm: Arm, seed: int, anchor: dict):
        if getattr(arm, "matched", False):
            # in place: ``cell`` records this dict, so the target the cell held is in its result
            anchor["target"] = MATCHED[(self.base_seed, post_set)]
        return super().train(where, post_set, arm, seed, anchor)

    def measure(self, where: Path, ckpt: Path, post_set: str, result: dict) -> dict:
        figures = super().measure(where, ckpt, post_set, result)
        figures["hold"] = trajectory(ckpt / "log.jsonl") | {"max_steps": self.post.max_steps}
        return figures

    def sigmoid_cell(self, post_set: str, seed: int) -> dict:
        """Base 0's control cell (``SIGMOID_ARM``)."""
        return self.cell(self.out / "sigmoid" / post_set / f"seed{seed}", post_set, SIGMOID_ARM, seed, None)

    def more_jobs(self, me) -> list:
        from rpb.toyworld.study.lanes import Job

        if self.base_seed != 0:
            return []
        return [
            Job(me.sigmoid_cell, (s, seed), label=f"{s} {SIGMOID_ARM.label} seed {seed}", counted=True)
            for s in self.grid.sets
            for seed in self.grid.seeds
        ]


def judge_hold_target(results: list[dict], sets: tuple[str, ...]) -> list[Verdict]:
    """The grid's claims 2-4 (module doc) on every set, Holm across them."""
    family: list[Verdict] = []

    def judged(rule, claim, arm, reference, post_set, metric, *args):
        return judge_paired(results, rule, claim, arm, reference, post_set, metric, *args)

    for s in sets:
        # fmt: skip below: one claim a row, its rule, arms, metric and margin side by side
        family += [
            judged(greater, f"(2) target 0.90 > target 0.70 ({s}, OOD)", "target 0.90", "target 0.70", s, "ood", 1),
            judged(threshold_above, f"(3) target matched − fixed λ > −{OOD_MARGIN[s]:g} points ({s}, OOD)",
                   "target matched", "routing-kd", s, "ood", -OOD_MARGIN[s]),
            judged(threshold_above, f"(4) target 0.70 − sft > −{ID_MARGIN[s]:g} points ({s}, ID)",
                   "target 0.70", "sft", s, "id", -ID_MARGIN[s]),
        ]  # fmt: skip
    return holm(family)


def report_hold_target(grid, studies: list, results: list[dict], out: Path) -> str:
    """The report across the bases (``rpb.toyworld.grids.hold_target_report``)."""
    from rpb.toyworld.grids.hold_target_report import write_hold_target_report

    return write_hold_target_report(grid, studies, results, out, judge_hold_target, ACCEPT_BAND, ACCEPT_TAIL)


GRID = Grid(
    "hold-target",
    POST_SETS,
    TARGET_ARMS,
    SEEDS,
    coefficients={},
    bases=BASES,
    post=STUDY_POST,
    about="routing-kd held to a routing target (0.70, 0.80, 0.90, the hold grid's own) against its fixed λ and sft",
    study=HoldTargetStudy,
    report=report_hold_target,
    claims=judge_hold_target,
)
