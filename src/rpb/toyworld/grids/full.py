"""``full``: every method of the paper, three seeds, both post-training sets, three bases (the controls this
project adds are outside it)."""

from rpb.anchors import METHODS
from rpb.toyworld.study.grid import BASES, SEEDS, STUDY_POST, Grid, arms
from rpb.toyworld.world.generators import POST_SETS

PAPER_METHODS = tuple(name for name, m in METHODS.items() if m.in_paper)

GRID = Grid(
    "full",
    POST_SETS,
    arms(*PAPER_METHODS),
    SEEDS,
    tables=("main", "forms", "controls", "mechanism"),
    bases=BASES,
    post=STUDY_POST,
    about="every method x 3 seeds x 2 sets x 3 bases",
)
