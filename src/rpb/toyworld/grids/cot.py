"""``cot``: sft, lbl, rpb and the four within-* controls on the long-trace set, three seeds, base 0, with the
transition retention of the traces (one step a line)."""

import dataclasses

from rpb.toyworld.study.grid import SEEDS, STUDY_POST, Grid, arms
from rpb.toyworld.study.tables import COT_COLUMNS
from rpb.toyworld.world.generators import TRACE_SETS

#: the grids' scoring with room for a 7-line trace (at most 123 tokens)
COT_POST = dataclasses.replace(STUDY_POST, max_seq_len=128)
COT_TABLE = (
    "Long traces: final line, line by line, and retention on the traces (static | transition | step)",
    COT_COLUMNS,
    True,
)

GRID = Grid(
    "cot",
    TRACE_SETS,
    arms("sft", "lbl", "rpb", "within-soft", "within-hard", "within-transition-soft", "within-transition-hard"),
    SEEDS,
    tables=("cot", "mechanism"),
    post=COT_POST,
    about="sft, lbl, rpb and the four within-* controls x 3 seeds on the long-trace set, base 0, with transition "
    "retention",
    table_kinds={"cot": COT_TABLE},
)
