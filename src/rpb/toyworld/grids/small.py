"""``small``: four methods, one seed, the math set, base 0 (the demo's recipe): minutes, not hours."""

from rpb.toyworld.study.grid import Grid, arms

GRID = Grid(
    "small",
    ("math_post",),
    arms("sft", "lbl", "rpb", "kl-to-base"),
    (42,),
    tables=("main", "forms"),
    about="4 methods x 1 seed on the math set",
)
