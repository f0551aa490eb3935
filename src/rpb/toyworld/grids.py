"""The toy-world study's grids: which post-training sets, arms (a method with its settings) and seeds a grid
runs, on which bases and with which post-training recipe; ``GRIDS`` names the ones ``rpb experiment`` and
``rpb demo`` run. ``rpb.toyworld.experiment`` runs them."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import ClassVar

from rpb.anchors import METHODS
from rpb.toyworld.generators import POST_SETS, TRACE_SETS
from rpb.toyworld.world import PostRecipe

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
    #: the prior an rpb arm trains with (``rpb.prior.PRIOR_KINDS``); a class fact, so no pinned grid changes
    prior_kind: ClassVar[str] = "probability"

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
    "headline": Grid(
        "headline",
        POST_SETS,
        (*_arms("sft", "lbl", "rpb"), CALIBRATED),
        HEADLINE_SEEDS,
        tables=("main", "mechanism"),
        bases=BASES,
        post=STUDY_POST,
    ),
    "full": Grid(
        "full",
        POST_SETS,
        _arms(*PAPER_METHODS),
        SEEDS,
        tables=("main", "forms", "controls", "mechanism"),
        bases=BASES,
        post=STUDY_POST,
    ),
    "cot": Grid(
        "cot",
        TRACE_SETS,
        _arms("sft", "lbl", "rpb", "within-soft", "within-hard", "within-transition-soft", "within-transition-hard"),
        SEEDS,
        tables=("cot", "mechanism"),
        post=COT_POST,
    ),
    "small": Grid("small", ("math_post",), _arms("sft", "lbl", "rpb", "kl-to-base"), (42,), tables=("main", "forms")),
    "beta": Grid(
        "beta", POST_SETS, BETA_ARMS, SEEDS, coefficients={}, tables=("beta", "mechanism"), bases=BASES, post=STUDY_POST
    ),
    "demo": Grid(
        "demo",
        ("math_post",),
        (*_arms("sft", "lbl", "rpb"), CALIBRATED),
        (42,),
        DEMO_COEFFICIENTS,
        ("demo", "mechanism"),
    ),
}


#: the transition levels a trace grid's cells keep from ``rpb retention --transitions --steps-by``
TRANSITION_KEYS = tuple(
    f"{level}transition_{k}" for level in ("", "step_") for k in ("nmi", "tvd", "row_jsd", "communities_base")
)
