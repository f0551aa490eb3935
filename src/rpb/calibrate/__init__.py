"""``rpb calibrate``: will the prior bias hold the base's routing or replace it? Measured on the
frozen base before any training (``run``), counted per sampled row for bootstrap intervals
(``measure``), reported (``report``), and read by a fixed rule into a recommended beta (``rule``)."""

from rpb.calibrate.rule import recommend_beta
from rpb.calibrate.run import DEFAULT_BETAS, DEFAULT_ROWS, calibrate

__all__ = ["DEFAULT_BETAS", "DEFAULT_ROWS", "calibrate", "recommend_beta"]
