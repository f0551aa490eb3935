"""What a grid is: which post-training sets, arms (a method with its settings) and seeds it runs, on which bases and
with which recipe (the fields ``grid.json`` pins), and how the study machinery runs, reports and judges it (the
fields it does not pin: ``Conduct``). Each grid is one module of ``rpb.toyworld.grids``; the machinery reads these
fields and never a grid's name.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import ClassVar

from rpb.anchors import METHODS
from rpb.toyworld.world.post import PostRecipe

#: the betas ``rpb calibrate`` is asked about (its nonzero ones) and a grid over beta runs
BETAS = (0.0, 0.25, 0.5, 1.0, 2.0, 4.0)
#: the grids' training seeds and bases
SEEDS = (42, 43, 44)
BASES = (0, 1, 2)
#: the grids' recipe: larger test sets (500 ID questions per set, 300 per pretraining domain; facts has
#: about 75 test phrasings) and every cell scored on the validation part too; the demo keeps PostRecipe()
STUDY_POST = PostRecipe(eval_id=500, eval_ood=300, score_parts=("validation", "test"))
#: ``field(**UNPINNED)``: a keyword-only field that says how a grid is run and judged, not what its results depend on:
#: ``grid.json`` does not pin it (``pinned_fields``) and grids compare equal without it
UNPINNED = {"metadata": {"pinned": False}, "compare": False, "kw_only": True}


@dataclass(frozen=True)
class Conduct:
    """How the study machinery runs, reports and judges a grid: every field unpinned, so that a change here never
    changes a shipped base's ``grid.json``. ``None`` takes the machinery's default."""

    #: one line for ``rpb experiment --help``
    about: str = field(default="", **UNPINNED)
    #: the ``Study`` class that runs one base (None: ``rpb.toyworld.study.cells.Study``)
    study: type | None = field(default=None, **UNPINNED)
    #: ``report(grid, studies, results, out) -> tables``: the report across bases (None: the paper's tables,
    #: ``rpb.toyworld.study.across.report_across``)
    report: Callable | None = field(default=None, **UNPINNED)
    #: ``claims(results, sets) -> verdicts`` the standard report judges (None: the paper's, ``study.claims.judge``)
    claims: Callable | None = field(default=None, **UNPINNED)
    #: the report judges ``rpb calibrate``'s beta rule against the grid's betas, so every base's calibration is made
    #: and ships though no arm trains at the calibrated beta
    judges_beta_rule: bool = field(default=False, **UNPINNED)
    #: table kinds of the grid's own, beside ``study.tables.TABLES``: {kind: (title, columns, every arm)}
    table_kinds: dict[str, tuple[str, tuple[str, ...], bool]] = field(default_factory=dict, **UNPINNED)
    #: with ``coefficients`` given, the weights they do not fix are chosen on validation among ``candidates``
    #: (otherwise a weight they do not fix is refused)
    selects_unfixed: bool = field(default=False, **UNPINNED)
    #: settings a pilot chose before the grid, for its report (``study.tables.weights_table``): (setting, the
    #: value chosen, its candidates, where the pilot ran); the chosen values themselves are pinned in the arms
    pilot_choices: tuple[tuple[str, float, tuple[float, ...], str], ...] = field(default=(), **UNPINNED)


def pinned_fields(grid) -> dict:
    """The grid's fields that ``grid.json`` pins: everything its results depend on (not ``Conduct``'s)."""
    kept = {f.name for f in dataclasses.fields(grid) if f.metadata.get("pinned", True)}
    return {k: v for k, v in dataclasses.asdict(grid).items() if k in kept}


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


def arms(*methods: str) -> tuple[Arm, ...]:
    """One arm per method, labelled by it."""
    return tuple(Arm(m, m) for m in methods)


#: rpb at the beta ``rpb calibrate`` recommends for the base, prior and data
CALIBRATED = Arm("rpb calibrated", "rpb", calibrated=True)


def table_weights() -> dict[str, tuple[float, ...]]:
    """The weights each weighted method of the paper asks a grid to try (the methods table's). A grid that runs a
    weighted method of rpb's own names its candidates: a method added to the table leaves every shipped grid's
    pinned candidates as they were."""
    return {name: m.weights for name, m in METHODS.items() if m.weights and m.in_paper}


@dataclass(frozen=True)
class Grid(Conduct):
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
