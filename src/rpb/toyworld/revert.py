"""The ``revert`` grid: does the routing drift that post-training makes matter? Each arm's model is run with the
base's routers put back (``rpb retention --revert-routers``) on the trained set and the four pretraining domains.

Cells: the ``full`` grid's ``sft``, ``rpb`` and ``kl-to-base`` arms and the ``rl`` grid's plain GRPO and ``R3`` arms,
retrained on every base at seeds 42-44 (the grids ship no checkpoints) with the recipes of those grids, so each
cell's exact match should be the shipped cell's (bit for bit on the machine type that ran it; within ±2 points, or
the note says why not). ``kl-to-base`` takes the weight the ``full`` grid chose on validation, 0.01 on each base.
The RL arms start from the ``rl`` grid's ``sft`` start and are reverted both to the base's routers and to the
start's.

Domains: each set's test questions as the grids score them (500 of the trained set ``math_post``, 300 of each
pretraining domain), NLL on the answer span, exact match by greedy decoding within the grids' answer budget.

The claim (fixed before the grid's first cell, 2026-12-06): reverting an ``sft`` model's routers to the base's
(1) raises the trained domain's answer NLL and (2) lowers the untargeted domains' (the mean over math, code, text
and facts). Each is judged on the per-cell change (reverted minus post) with the grids' two-stage bootstrap over
the three bases and their seeds (``rpb.toyworld.stats.greater``), Holm across the two. The other arms' changes are
reported beside it, not judged.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field

from rpb.toyworld.generators import DOMAINS
from rpb.toyworld.grids import BASES, SEEDS, STUDY_POST, Arm
from rpb.toyworld.rl import RL_GRID, RLArm, RLGrid, RLRecipe
from rpb.toyworld.stats import Verdict, greater, holm
from rpb.toyworld.world import PostRecipe

#: the trained set of every arm (the RL arms' start was trained on it, and their prompts are its questions)
TRAINED = "math_post"
#: the weight the ``full`` grid chose for ``kl-to-base`` on validation, the same on its three bases
#: (docs/results/full/base*/selection.json; tests/toyworld/test_revert.py reads them)
KL_WEIGHT = 0.01
REVERT_ARMS = (
    Arm("sft", "sft"),
    Arm("rpb", "rpb"),
    Arm("kl-to-base", "kl-to-base"),
    RLArm("grpo"),
    RLArm("grpo + R3", replay="R3"),
)
#: what a reverted model is compared with: the base's routers, and (RL arms) their sft start's
REFERENCES = ("base", "start")


@dataclass(frozen=True)
class RevertGrid:
    """The ``revert`` grid (module docstring); its fields are those the grids' runner and shipping read."""

    name: str
    sets: tuple[str, ...]
    arms: tuple[Arm | RLArm, ...]
    seeds: tuple[int, ...]
    bases: tuple[int, ...]
    post: PostRecipe
    coefficients: dict[str, float]
    #: the RL arms' recipe and start (the ``rl`` grid's)
    recipe: RLRecipe = field(default_factory=RLRecipe)
    start_seed: int = RL_GRID.start_seed
    domains: tuple[str, ...] = (TRAINED, *DOMAINS)

    def rl_grid(self) -> RLGrid:
        """The ``rl`` grid restricted to this grid's RL arms (what trains them, from the same start)."""
        arms = tuple(a for a in self.arms if isinstance(a, RLArm))
        return dataclasses.replace(RL_GRID, arms=arms, seeds=self.seeds, bases=self.bases, post=self.post)


REVERT_GRID = RevertGrid(
    "revert", (TRAINED,), REVERT_ARMS, SEEDS, BASES, STUDY_POST, {"kl-to-base": KL_WEIGHT}, RL_GRID.recipe
)


def per_base(results: list[dict], arm: str, reference: str, domain: str, key: str = "delta_nll") -> dict:
    """{base: values of ``key`` for ``domain`` over the arm's cells} (a variant's figure as ``variant/figure``)."""
    out: dict[int, list[float]] = {}
    for r in sorted((r for r in results if r["arm"] == arm), key=lambda r: (r["base"], r["seed"])):
        entry = r["revert"].get(reference, {}).get(domain)
        if entry is None:
            continue
        if "/" in key:
            variant, figure = key.split("/")
            value = entry["variants"][variant][figure]
        else:
            value = entry[key]
        out.setdefault(r["base"], []).append(value)
    return out


def changes(results: list[dict], arm: str, domains: tuple[str, ...], reference: str = "base") -> dict[int, list]:
    """{base: per-cell change in answer NLL from reverting ``arm``'s routers to ``reference``'s, averaged over
    ``domains``}, cells in seed order."""
    each = [per_base(results, arm, reference, d) for d in domains]
    return {b: [sum(cell) / len(domains) for cell in zip(*(e[b] for e in each), strict=True)] for b in each[0]}


def judge_revert(results: list[dict]) -> list[Verdict]:
    """The claim (module docstring): two verdicts, Holm across them; "not run" while no sft cell is there."""
    claims = (
        ("reverting sft's routers raises the trained domain's NLL", (TRAINED,), 1),
        ("reverting sft's routers lowers the untargeted domains' NLL (mean of 4)", DOMAINS, -1),
    )
    verdicts = []
    for claim, domains, direction in claims:
        d = changes(results, "sft", domains)
        if not d:
            verdicts.append(Verdict(claim, float("nan"), (float("nan"),) * 2, float("nan"), "not run"))
            continue
        verdicts.append(greater(claim, d, direction, f"{sum(map(len, d.values()))} cells, ΔNLL nats/token"))
    return holm(verdicts)
