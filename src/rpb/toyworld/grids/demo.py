"""``demo``: the README's main command (``rpb demo``): sft, lbl, rpb and rpb at the calibrated beta on the math set,
one seed, the base shipped as base 0, the load-balancing weight fixed (no search, to fit its time budget)."""

from rpb.toyworld.study.grid import CALIBRATED, Grid, arms

#: the pretraining's load-balancing weight
DEMO_COEFFICIENTS = {"lbl": 0.01}
#: the demo's table: exact match and routing retention side by side
DEMO_TABLE = ("Demo", ("id", "ood", "tvd", "topk_overlap", "nmi"), True)

GRID = Grid(
    "demo",
    ("math_post",),
    (*arms("sft", "lbl", "rpb"), CALIBRATED),
    (42,),
    DEMO_COEFFICIENTS,
    ("demo", "mechanism"),
    about="the README's `rpb demo`: sft, lbl, rpb, rpb at the calibrated beta x 1 seed on the math set, base 0",
    table_kinds={"demo": DEMO_TABLE},
)
