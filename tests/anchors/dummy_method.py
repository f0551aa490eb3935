"""A loss-based method that exists only in the tests: its entry and its math, registered by a fixture.

It stands for what a contributor writes to add a method (one ``Method`` entry with a ``LossAnchor``,
and a pure function of the router's state); everything else -- the HF hook, the Megatron router,
the toy-world grids' weight search and the study tables -- must pick it up from the methods table.
The term: the mean over valid tokens of the mean squared router logit (a "logit norm").
"""

from __future__ import annotations

import contextlib

import torch

from rpb.anchors import METHODS, LossAnchor, Method, RouterState, register_method

NAME = "logit-norm"
WEIGHTS = (0.5, 5.0)


def logit_norm(state: RouterState) -> torch.Tensor:
    w_T = state.valid_T.float()
    return (state.logits_TE.float().pow(2).mean(-1) * w_T).sum() / w_T.sum().clamp_min(1)


def by_hand(logits_TE: torch.Tensor, valid_T: torch.Tensor) -> float:
    """The same term written out token by token on Python floats."""
    rows = [
        sum(v * v for v in row) / len(row)
        for row, keep in zip(logits_TE.tolist(), valid_T.tolist(), strict=True)
        if keep
    ]
    return sum(rows) / max(len(rows), 1)


@contextlib.contextmanager
def registered():
    method = Method(
        NAME,
        "+ `lambda` × mean squared router logit (a test's method)",
        loss=LossAnchor(logit_norm, frozenset({"logits"})),
        coefficient="lambda_",
        weights=WEIGHTS,
        tables=("forms",),
    )
    register_method(method)
    try:
        yield method
    finally:
        del METHODS[NAME]
