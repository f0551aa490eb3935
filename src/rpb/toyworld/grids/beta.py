"""``beta``: rpb over beta (0 is sft bit for bit) and rpb-hard, three seeds, both sets, three bases; its report
judges ``rpb calibrate``'s beta rule against the best beta it ran."""

from rpb.toyworld.study.grid import BASES, BETAS, SEEDS, STUDY_POST, Arm, Grid
from rpb.toyworld.world.generators import POST_SETS

BETA_ARMS = (*(Arm(f"rpb beta={b:g}", "rpb", (("beta", b),)) for b in BETAS), Arm("rpb hard", "rpb-hard"))
BETA_TABLE = ("Enforcement strength (beta)", ("id", "ood", "tvd", "topk_overlap", "nmi"), True)

GRID = Grid(
    "beta",
    POST_SETS,
    BETA_ARMS,
    SEEDS,
    coefficients={},
    tables=("beta", "mechanism"),
    bases=BASES,
    post=STUDY_POST,
    about="rpb over beta x 3 seeds x 2 sets x 3 bases, and the beta rule's regret",
    judges_beta_rule=True,
    table_kinds={"beta": BETA_TABLE},
)
