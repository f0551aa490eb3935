"""``headline``: sft, lbl, rpb and rpb at the calibrated beta, five seeds, both post-training sets, three bases."""

from rpb.toyworld.study.grid import BASES, CALIBRATED, STUDY_POST, Grid, arms
from rpb.toyworld.world.generators import POST_SETS

#: five seeds, as the paper's headline comparison turned out bimodal by training seed
HEADLINE_SEEDS = (42, 43, 44, 45, 46)

GRID = Grid(
    "headline",
    POST_SETS,
    (*arms("sft", "lbl", "rpb"), CALIBRATED),
    HEADLINE_SEEDS,
    tables=("main", "mechanism"),
    bases=BASES,
    post=STUDY_POST,
    about="sft, lbl, rpb, rpb at the calibrated beta x 5 seeds x 2 sets x 3 bases",
)
