"""The ``rl`` grid's claims and its collapse rule, fixed before its first cell (issue 51), judged by the grids'
own rules (``rpb.toyworld.study.stats``: the two-stage bootstrap over bases, Holm across the claims).

A cell's figures (``stats.points``): ``id`` / ``ood`` exact match in points on the test part (out of domain: the
four pretraining domains); from ``result["retention"]``: ``start_topk_overlap`` (top-k overlap of the cell's
routing with its ``sft`` start's), ``flip_rate`` (the mean ``routing/rollout_flip_rate`` over training) and
``logp_gap`` (the mean absolute rollout-vs-training log-probability difference over training, every completion
token). Margins and directions are the issue's, unchanged:

1. plain GRPO moves the routing away from its start (top-k overlap) more than every anchored arm;
2. ``R3`` lowers the flip rate against plain GRPO;
3. ``R3`` leaves in-domain exact match unchanged: equivalence within ±3 points (collapses reported per arm);
4. ``kl-to-base`` keeps the untargeted domains better than plain GRPO, at an in-domain cost under 2 points;
5. ``router-freeze`` ≈ ``kl-to-base`` within ±2 points, in and out of domain;
6. ``rpb`` keeps the untargeted domains better than plain GRPO, and its bias-free rollouts raise the flip rate;
7. GSPO without replay reaches ``R3``'s in-domain exact match within ±3 points;
8. ``R3`` lowers the log-probability gap against plain GRPO, and ``R2``'s gap is plain GRPO's within ±20% of
   plain GRPO's value (an equivalence on the relative difference, in percent).

**Collapse** (``collapsed``), fixed from the pilot: the reward (one value per generation batch), smoothed over a
window of a twentieth of its values, falls below half of its best so far and does not come back above that half
within the next tenth of its values; or a loss is not finite. The pilot (plain GRPO from base 0's retrained
``sft`` start, 300 steps at learning rate 5e-5, 32 completions per generation batch, two updates each, bf16
rollouts; run outside the grid and discarded) gave 150 rewards with a standard deviation of 0.095 around their
7-value running mean while that mean rose from 0.22 to 0.56: the window keeps that noise well inside half of
the best, and the pilot does not collapse under the rule.
"""

from __future__ import annotations

import math

import numpy as np

from rpb.toyworld.study.grid import BASES, SEEDS, STUDY_POST
from rpb.toyworld.study.rl import RLGrid
from rpb.toyworld.study.stats import (
    Verdict,
    cost_under,
    equivalent,
    extreme,
    greater,
    holm,
    not_run,
    paired_differences,
    relative_differences,
)
from rpb.toyworld.world.rl import RLArm

PLAIN = "grpo"
ANCHORED = ("grpo + lbl", "grpo + R2", "grpo + R3", "grpo + kl-to-base", "grpo + router-freeze", "grpo + rpb")


def collapsed(reward: list[float | None], loss: list[float | None]) -> bool:
    """The collapse rule (module docstring) over one cell's per-step reward (None: a step without generation)
    and loss."""
    if any(x is not None and not math.isfinite(x) for x in loss):
        return True
    values = [x for x in reward if x is not None]
    if not values:
        return False
    window = max(1, len(values) // 20)
    smooth = np.convolve(values, np.ones(window) / window, mode="valid")
    patience = max(1, len(values) // 10)
    best = -math.inf
    for i, value in enumerate(smooth):
        best = max(best, value)
        if value < best / 2 and not any(later >= best / 2 for later in smooth[i + 1 : i + 1 + patience]):
            return True
    return False


def _free_flips(results: list[dict], diffs: dict) -> dict:
    """Claim 2's differences, where R3's cells hold a flip rate: cells made since R3 logs its override rate instead
    (another figure: the router's own choice on the rollout's routing, docs/rl.md) hold none, and the claim is not
    run on them rather than judged on a figure that is not the flip rate."""
    r3 = [r for r in results if r["arm"] == "grpo + R3"]
    return diffs if r3 and all("flip_rate" in r.get("retention", {}) for r in r3) else {}


def judge_rl(results: list[dict], sets: tuple[str, ...] = ("math_post",)) -> list[Verdict]:
    """The eight claims (some in two parts) on the grid's cells (its set: ``sets[0]``), Holm-adjusted across them."""
    arms, post_set = {r["arm"] for r in results}, sets[0]

    def d(arm, reference, metric):
        return paired_differences(results, post_set, arm, reference, metric) if {arm, reference} <= arms else {}

    def ran(verdict_of, claim, diffs, *args):
        if diffs:
            return verdict_of(claim, diffs, *args)
        return not_run(claim)

    pairwise = {a: d(PLAIN, a, "start_topk_overlap") for a in ANCHORED if a in arms}
    out = [
        extreme("1. plain GRPO moves the routing from its start most (top-k overlap lowest)", pairwise, -1)
        if pairwise
        else not_run("1. plain GRPO moves the routing most"),
        ran(greater, "2. R3 lowers the flip rate", _free_flips(results, d("grpo + R3", PLAIN, "flip_rate")), -1),
        ran(equivalent, "3. R3 ≈ plain GRPO in domain (±3)", d("grpo + R3", PLAIN, "id"), 3.0),
        ran(greater, "4. kl-to-base keeps OOD better than plain GRPO", d("grpo + kl-to-base", PLAIN, "ood"), +1),
        ran(cost_under, "4b. kl-to-base's in-domain cost under 2 points", d("grpo + kl-to-base", PLAIN, "id"), 2.0),
    ]
    for metric in ("id", "ood"):
        diffs = d("grpo + router-freeze", "grpo + kl-to-base", metric)
        out.append(ran(equivalent, f"5. router-freeze ≈ kl-to-base ({metric.upper()}, ±2)", diffs, 2.0))
    out += [
        ran(greater, "6. rpb keeps OOD better than plain GRPO", d("grpo + rpb", PLAIN, "ood"), +1),
        ran(greater, "6b. rpb's bias-free rollouts raise the flip rate", d("grpo + rpb", PLAIN, "flip_rate"), +1),
        ran(equivalent, "7. GSPO ≈ GRPO + R3 in domain (±3)", d("gspo", "grpo + R3", "id"), 3.0),
        ran(greater, "8. R3 lowers the log-probability gap", d("grpo + R3", PLAIN, "logp_gap"), -1),
    ]
    relative = relative_differences(results, post_set, "grpo + R2", PLAIN, "logp_gap") if "grpo + R2" in arms else {}
    out.append(ran(equivalent, "8b. R2's gap ≈ plain GRPO's (±20%)", relative, 20.0))
    return holm(out)


#: each claim's pairs (arm, reference, figure; relative: in percent of the reference), as ``judge_rl`` forms them
CLAIM_PAIRS = (
    ("2", "grpo + R3", PLAIN, "flip_rate", False),
    ("3", "grpo + R3", PLAIN, "id", False),
    ("4", "grpo + kl-to-base", PLAIN, "ood", False),
    ("4b", "grpo + kl-to-base", PLAIN, "id", False),
    ("5 ID", "grpo + router-freeze", "grpo + kl-to-base", "id", False),
    ("5 OOD", "grpo + router-freeze", "grpo + kl-to-base", "ood", False),
    ("6", "grpo + rpb", PLAIN, "ood", False),
    ("6b", "grpo + rpb", PLAIN, "flip_rate", False),
    ("7", "gspo", "grpo + R3", "id", False),
    ("8", "grpo + R3", PLAIN, "logp_gap", False),
    ("8b", "grpo + R2", PLAIN, "logp_gap", True),
)
#: the GSPO paper's settings as TRL documents them: sequence-level ratios, its narrow clipping, no KL
GSPO = (("importance_sampling_level", "sequence"), ("loss_type", "grpo"), ("epsilon", 3e-4), ("epsilon_high", 4e-4))
# fmt: skip below: a table of data, one arm a row
RL_ARMS = (
    RLArm(PLAIN),
    RLArm("grpo + lbl", "lbl"),
    RLArm("grpo + R2", replay="R2"),
    RLArm("grpo + R3", replay="R3"),
    RLArm("gspo", trl=GSPO),
    RLArm("grpo + kl-to-base", "kl-to-base"),
    RLArm("grpo + router-freeze", "router-freeze"),
    RLArm("grpo + rpb", "rpb"),
)  # fmt: skip

GRID = RLGrid(
    "rl",
    ("math_post",),
    RL_ARMS,
    SEEDS,
    BASES,
    STUDY_POST,
    about="GRPO from each base's sft cell, 8 arms (replay, GSPO, anchors) x 3 seeds x 3 bases",
    claims=judge_rl,
    collapsed=collapsed,
    reference=PLAIN,
    claim_pairs=CLAIM_PAIRS,
    start_recipe="the `full` grid's recipe",
)
