"""``hold``: does holding the routing itself keep what the base knew? ``routing-kd`` (the base's routing on its own
hidden states as the target) against the remedies a user tries first, on the ``full`` grid's recipe and data.

Arms, on math_post and code_post x 3 bases x 3 seeds:

* ``sft``, ``kl-to-base`` (the ``full`` grid's weight, 0.01 on each base) and ``rpb`` (its beta, 1): the ``full``
  grid's own cells, copied byte for byte where the repository ships them for the same base and recipe
  (``rpb.toyworld.study.paired.PairedStudy``), trained here where it does not;
* ``routing-kd`` from the base's online forward, and ``routing-kd routes`` from its stored top-k routes (``rpb
  routes``, ids alone, as an engine returns them: the set cross-entropy), each with its weight chosen per base on
  validation among 0.01, 0.1, 1 and 10 (separately);
* ``output-kd``, self-distillation on the base's next-token distribution (0.01, 0.1 or 1 on validation);
* ``mix``: ``sft`` with the four pretraining domains' training questions in 10% of the rows (2.5% each, in the
  places of as many post-training rows; none is a validation or test question), and ``mix + routing-kd``, the same
  data with ``routing-kd`` at the online arm's weight.

Every cell is scored and measured as the grids do (exact match ID and OOD on the test part, retention on the probe
set). The ``revert`` test (the base's routers put back, ``rpb retention --revert-routers``) runs on the ``sft`` and
``routing-kd`` cells: on the trained set and the four pretraining domains, answer NLL and exact match. The ``sft``
cells being the ``full`` grid's (no checkpoint ships), each is trained again for it (``revert/``); its exact match
is reported beside the copied cell's.

The claims (``judge_hold``) and their margins were fixed before the grid's first cell (this module's first
commit): per set, judged with the grids' two-stage bootstrap over the bases and their seeds and Holm across
the family:

1. ``routing-kd`` keeps the top-k overlap with the base (``retention.topk_overlap``, probe set) above ``sft``'s by
   more than ``OVERLAP_GAIN``: the lower 95% bound of the paired difference above +0.1;
2. ``routing-kd`` keeps out-of-domain exact match better than ``sft`` (the difference above 0);
3. its in-domain cost against ``sft`` lies within ±``ID_MARGIN`` points (two one-sided tests);
4. stored routes ≈ online: overlap within ±``ROUTES_OVERLAP_MARGIN`` and OOD within ±``ID_MARGIN`` points;
5. ``output-kd`` keeps OOD better than ``sft``;
7. ``mix + routing-kd`` keeps OOD better than ``mix`` alone;
8. the paired overlap difference ``routing-kd`` − ``kl-to-base`` is above 0.

(6) ``routing-kd`` against ``output-kd`` out of domain is reported with its interval, outside the Holm family.
"""

from __future__ import annotations

import dataclasses
import math
import shutil
from dataclasses import dataclass
from functools import partial
from pathlib import Path
from typing import ClassVar

from rpb.toyworld.study.grid import BASES, SEEDS, STUDY_POST, Arm, Grid
from rpb.toyworld.study.paired import PairedStudy
from rpb.toyworld.study.stats import (
    Verdict,
    equivalent,
    greater,
    holm_beside,
    judge_paired,
    threshold_above,
)
from rpb.toyworld.world.generators import DOMAINS, POST_SETS
from rpb.toyworld.world.post import eval_tasks, mixing_tasks, train_cell, write_rows

#: the share of the training rows the four pretraining domains take in the mixed arms, in all (a quarter each)
MIX_SHARE = 0.10
#: claim 1: the top-k overlap ``routing-kd`` must keep above ``sft``'s (the lower 95% bound of the difference)
OVERLAP_GAIN = 0.1
#: claims 3 and 4: exact-match margins in points
ID_MARGIN = 2.0
#: claim 4: the overlap margin of stored routes against the online base
ROUTES_OVERLAP_MARGIN = 0.05
#: the arms the revert test runs on
REVERTED = ("sft", "routing-kd")
#: the weights the ``routing-kd`` selections try, and ``output-kd``'s
ROUTING_KD_WEIGHTS = (0.01, 0.1, 1.0, 10.0)
OUTPUT_KD_WEIGHTS = (0.01, 0.1, 1.0)
#: ``kl-to-base``'s weight: the ``full`` grid's choice on validation, 0.01 on each of its bases
KL_WEIGHT = 0.01
#: the selection of the stored-routes arm (its own weight; the online arm's is ``routing-kd``'s)
ROUTES_SELECTION = "routing-kd-routes"
#: the stored-routes arm's anchor: ids alone, under the form it ran with (set-ce, the ids-alone default until the
#: hinge replaced it), named so that the shipped cells keep meaning what they ran
STORED_ANCHOR = (("base", "routes"), ("routes_loss", "set-ce"))


@dataclass(frozen=True)
class HoldArm(Arm):
    """An arm of the ``hold`` grid: ``mix`` is the share of the rows the pretraining domains take (0: none);
    ``selection`` the weight selection it reads (None: its method's)."""

    mix: float = 0.0
    selection: str | None = None


HOLD_ARMS = (
    HoldArm("sft", "sft"),
    HoldArm("routing-kd", "routing-kd"),
    HoldArm("routing-kd routes", "routing-kd", STORED_ANCHOR, selection=ROUTES_SELECTION),
    HoldArm("output-kd", "output-kd"),
    HoldArm("kl-to-base", "kl-to-base"),
    HoldArm("mix", "sft", mix=MIX_SHARE),
    HoldArm("mix + routing-kd", "routing-kd", mix=MIX_SHARE),
    HoldArm("rpb", "rpb"),
)


@dataclass(frozen=True)
class HoldGrid(Grid):
    """The ``hold`` grid: its ``sft``, ``kl-to-base`` and ``rpb`` cells are the ``full`` grid's (``PairedStudy``)."""

    paired_grid: ClassVar[str] = "full"


@dataclasses.dataclass
class HoldStudy(PairedStudy):
    """One base of the ``hold`` grid (module doc)."""

    #: what a base ships besides the grids' files (``study.shipping``): the retrained ``sft`` cells' revert records
    ships = ("revert/*/*/*/result.json",)

    def selection_key(self, arm: Arm) -> str | None:
        own = getattr(arm, "selection", None)
        return own if own is not None else super().selection_key(arm)

    def selection_arm(self, key: str) -> Arm:
        if key == ROUTES_SELECTION:
            return HoldArm(ROUTES_SELECTION, "routing-kd", STORED_ANCHOR, selection=ROUTES_SELECTION)
        return super().selection_arm(key)

    def paired_cell(self, post_set: str, arm: Arm, seed: int) -> Path | None:
        # only the arms the full grid runs as they are: the mixed sft arm is another cell than its sft
        if getattr(arm, "mix", 0.0) or arm.label not in ("sft", "kl-to-base", "rpb"):
            return None
        return super().paired_cell(post_set, arm, seed)

    # ------------------------------------------------------------------ inputs

    def mix_file(self, domain: str) -> Path:
        """The data-mixing rows of ``domain``: as many as the largest share of it any arm takes."""
        path = self.out / "data" / "mix" / f"{domain}.jsonl"
        if not path.is_file():
            n = math.ceil(MIX_SHARE / len(DOMAINS) * self.post.train_rows)
            write_rows(mixing_tasks(domain, n, self.post), path)
        return path

    def routes(self, post_set: str) -> Path:
        """The base's top-k routes over the set's training rows (``rpb routes``: ids alone, an engine's view)."""
        from rpb.collect.hf_routes import write_routes

        path = self.out / "routes" / f"{post_set}.safetensors"
        if not path.is_file():  # written atomically: present means complete
            write_routes(str(self.base()), self.data(post_set), path, self.post.max_seq_len, batch_size=64)
        return path

    def domain_file(self, domain: str) -> Path:
        """A domain's test questions as the grids score them, as JSONL rows (the revert test's)."""
        path = self.out / "data" / "revert" / f"{domain}.jsonl"
        if not path.is_file():
            n = self.post.eval_id if domain in POST_SETS else self.post.eval_ood
            write_rows(eval_tasks(domain, "test", n, self.post.base.domain_params()), path)
        return path

    def prepare(self) -> None:
        for d in DOMAINS:
            self.mix_file(d)
            self.domain_file(d)
        for s in self.grid.sets:
            self.routes(s)
            self.domain_file(s)

    # ------------------------------------------------------------------ cells

    def train(self, where: Path, post_set: str, arm: Arm, seed: int, anchor: dict):
        mix = getattr(arm, "mix", 0.0)
        data_mix = [{"path": str(self.mix_file(d)), "share": mix / len(DOMAINS)} for d in DOMAINS] if mix else None
        run_anchor = dict(anchor)
        if run_anchor.get("base") == "routes":  # the route file's path is this run folder's: not in the record
            run_anchor["routes"] = str(self.routes(post_set))
        ckpt, train_s = train_cell(
            self.base(),
            self.data(post_set),
            self.prior(post_set) if arm.method == "rpb" else None,
            where / "model",
            arm.method,
            seed,
            self.post,
            run_anchor,
            progress=self.progress,
            label=f"{post_set} {arm.label} seed {seed}",
            data_mix=data_mix,
        )
        return ckpt, train_s, {"mix": mix} if mix else {}

    def measure(self, where: Path, ckpt: Path, post_set: str, result: dict) -> dict:
        figures = super().measure(where, ckpt, post_set, result)
        if result["arm"] in REVERTED:
            figures["revert"] = self.revert(where, ckpt, post_set)
        return figures

    def revert(self, where: Path, ckpt: Path, post_set: str) -> dict:
        """The base's routers put back into the trained model: answer NLL, exact match and top-k overlap with the
        base of each variant, per domain (the trained set and the four pretraining domains)."""
        from rpb.retention.revert_run import run_revert
        from rpb.toyworld.world.tasks import answer_budget

        domains = {d: self.domain_file(d) for d in (post_set, *DOMAINS)}
        report = run_revert(
            str(self.base()),
            str(ckpt),
            domains,
            where / "revert",
            generate=True,
            max_new_tokens=max(answer_budget(d) for d in domains),
            batch_size=64,
            max_seq_len=self.post.max_seq_len,
            progress=False,
        )
        shutil.rmtree(where / "revert", ignore_errors=True)
        out = {}
        for d, entry in report["sets"].items():
            variants = {
                v: {"nll": f["nll"], "exact_match": f.get("exact_match"), "topk_overlap": f["topk_overlap"]["all"]}
                for v, f in entry["variants"].items()
            }
            delta = entry["delta_nll"]
            out[d] = {"rows": entry["rows"], "variants": variants, "delta_nll": delta["estimate"]}
            out[d]["delta_nll_ci"] = delta["ci"]
        return out

    def revert_cell(self, post_set: str, seed: int) -> dict:
        """The ``sft`` cell trained again (the grid's copy carries no checkpoint) and reverted; its own scores
        beside the revert figures."""
        return self.cell(self.out / "revert" / post_set / "sft" / f"seed{seed}", post_set, HOLD_ARMS[0], seed, None)

    def more_jobs(self, me) -> list:
        from rpb.toyworld.study.lanes import Job

        return [
            Job(me.revert_cell, (s, seed), label=f"revert {s} sft seed {seed}", counted=True)
            for s in self.grid.sets
            for seed in self.grid.seeds
        ]


def judge_hold(results: list[dict], sets: tuple[str, ...]) -> list[Verdict]:
    """The grid's claims (module doc) on every set, Holm across claims 1-5, 7 and 8; claim 6 after them, unadjusted."""
    family: list[Verdict] = []
    outside: list[Verdict] = []
    judged = partial(judge_paired, results)
    for s in sets:
        # fmt: skip below: one claim a row, its rule, arms, metric and margin side by side
        family += [
            judged(threshold_above, f"(1) routing-kd keeps top-k overlap: routing-kd − sft > +{OVERLAP_GAIN:g} ({s})",
                   "routing-kd", "sft", s, "topk_overlap", OVERLAP_GAIN),
            judged(greater, f"(2) routing-kd > sft ({s}, OOD)", "routing-kd", "sft", s, "ood", 1),
            judged(equivalent, f"(3) routing-kd ≈ sft in domain, ±{ID_MARGIN:g} points ({s}, ID)",
                   "routing-kd", "sft", s, "id", ID_MARGIN),
            judged(equivalent, f"(4a) stored routes ≈ online, overlap ±{ROUTES_OVERLAP_MARGIN:g} ({s})",
                   "routing-kd routes", "routing-kd", s, "topk_overlap", ROUTES_OVERLAP_MARGIN),
            judged(equivalent, f"(4b) stored routes ≈ online, OOD ±{ID_MARGIN:g} points ({s})",
                   "routing-kd routes", "routing-kd", s, "ood", ID_MARGIN),
            judged(greater, f"(5) output-kd > sft ({s}, OOD)", "output-kd", "sft", s, "ood", 1),
            judged(greater, f"(7) mix + routing-kd > mix ({s}, OOD)", "mix + routing-kd", "mix", s, "ood", 1),
            judged(greater, f"(8) routing-kd − kl-to-base > 0 in top-k overlap ({s})",
                   "routing-kd", "kl-to-base", s, "topk_overlap", 1),
        ]  # fmt: skip
        claim = f"(6) routing-kd vs output-kd ({s}, OOD)"
        outside.append(judged(greater, claim, "routing-kd", "output-kd", s, "ood", 1))
    return holm_beside(family, outside)


def report_hold(grid, studies: list, results: list[dict], out: Path) -> str:
    """The report across the bases (``rpb.toyworld.grids.hold_report``)."""
    from rpb.toyworld.grids.hold_report import write_hold_report

    return write_hold_report(grid, studies, results, out, judge_hold)


GRID = HoldGrid(
    "hold",
    POST_SETS,
    HOLD_ARMS,
    SEEDS,
    coefficients={"kl-to-base": KL_WEIGHT},
    candidates={"routing-kd": ROUTING_KD_WEIGHTS, ROUTES_SELECTION: ROUTING_KD_WEIGHTS, "output-kd": OUTPUT_KD_WEIGHTS},
    bases=BASES,
    post=STUDY_POST,
    about="routing-kd (online and stored routes) against sft, output-kd, kl-to-base, data mixing and rpb",
    study=HoldStudy,
    report=report_hold,
    claims=judge_hold,
    selects_unfixed=True,
)
