"""The report's figures for a grid on several bases, drawn from the report's own statistics.

``forest.svg``: each method minus the reference arm (``sft``; the beta grid's beta-0 arm) on the same
(base, seed), in exact-match points, with the 95% two-stage bootstrap interval the tables give, in-domain and
out-of-domain, one panel per post-training set. ``claims.svg``: each claim the grid ran, its verdict by the
rule and after Holm's correction across the claims, as the claims table gives them.

The SVGs carry no date, and matplotlib's ids come from a fixed salt, so the same cells give the same bytes
(tests/project/test_shipped_results.py compares the shipped ones with a fresh render). Each figure function
returns the Figure, so a test can read the plotted values back from its artists.
"""

from __future__ import annotations

import contextlib
import statistics
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path

import matplotlib as mpl
import matplotlib.style
from matplotlib.backends.backend_agg import FigureCanvasAgg
from matplotlib.figure import Figure
from matplotlib.patches import Rectangle

from rpb.fileio import atomic_path
from rpb.toyworld.study.stats import Verdict

#: a fixed salt for the ids matplotlib writes into an SVG (else random per process); text kept as text (a
#: quarter of the bytes of glyph paths, and searchable), in matplotlib's own font
STYLE = {"svg.hashsalt": "rpb-toyworld", "svg.fonttype": "none", "font.size": 9}
#: no date, and no matplotlib version either: neither says anything about the cells
METADATA = {"Date": None, "Creator": "rpb"}
METRIC_LABELS = {"id": "in-domain (ID)", "ood": "out-of-domain (OOD)"}
METRIC_STYLE = {"id": ("#1f5fa8", "o", -0.16), "ood": ("#d9782d", "s", +0.16)}  # colour, marker, row offset
VERDICT_COLOURS = {"reproduces": "#a8dbb5", "contradicted": "#f2a7a7", "inconclusive": "#e3e3e3"}
COLUMNS = ("verdict by rule", "after Holm")
FOREST, CLAIMS = "forest.svg", "claims.svg"


@dataclass(frozen=True)
class Difference:
    """One method minus the reference on one set and metric (``id`` / ``ood``): the paired differences per base,
    in points, and the 95% interval of their mean."""

    post_set: str
    arm: str
    metric: str
    reference: str
    per_base: dict[int, list[float]]
    lo: float
    hi: float

    @property
    def values(self) -> list[float]:
        return [v for _, vs in sorted(self.per_base.items()) for v in vs]

    @property
    def mean(self) -> float:
        return statistics.fmean(self.values)


@contextlib.contextmanager
def _style():
    """matplotlib's defaults (not a local matplotlibrc's), then ``STYLE``, for this figure alone: the figure and
    its bytes depend on the cells only."""
    with mpl.style.context("default"), mpl.rc_context(STYLE):
        yield


def _unique(items: Iterable[str]) -> list[str]:
    return list(dict.fromkeys(items))


def _figure(width: float, height: float) -> Figure:
    fig = Figure(figsize=(width, height), layout="constrained")
    FigureCanvasAgg(fig)
    return fig


def forest(differences: list[Difference], title: str) -> Figure:
    """One panel per set, one row per method (in the order given), ID and OOD side by side in each row: the mean
    difference as a marker, its interval as a line; a dashed line at no difference."""
    with _style():
        sets, arms = _unique(d.post_set for d in differences), _unique(d.arm for d in differences)
        references = _unique(d.reference for d in differences)
        fig = _figure(1.2 + 3.6 * max(len(sets), 1), 1.7 + 0.42 * max(len(arms), 1))
        axes = fig.subplots(1, max(len(sets), 1), sharey=True, squeeze=False)[0]
        for ax, post_set in zip(axes, sets, strict=False):
            ax.axvline(0.0, color="0.35", lw=0.9, ls="--", gid=f"{post_set}-zero")
            for metric, label in METRIC_LABELS.items():
                rows = [d for d in differences if d.post_set == post_set and d.metric == metric]
                if not rows:
                    continue
                colour, marker, offset = METRIC_STYLE[metric]
                ys = [arms.index(d.arm) + offset for d in rows]
                ax.hlines(
                    ys,
                    [d.lo for d in rows],
                    [d.hi for d in rows],
                    colors=colour,
                    lw=1.8,
                    gid=f"{post_set}-{metric}-interval",
                )
                ax.plot(
                    [d.mean for d in rows],
                    ys,
                    ls="none",
                    marker=marker,
                    ms=5,
                    color=colour,
                    label=label,
                    gid=f"{post_set}-{metric}-mean",
                )
            ax.set_title(post_set)
            ax.set_xlabel(f"difference from {' / '.join(references)}\n(exact match, points)")
            ax.grid(axis="x", color="0.88", lw=0.6)
            ax.set_axisbelow(True)
        axes[0].set_yticks(range(len(arms)), arms)
        axes[0].set_ylim(len(arms) - 0.5, -0.5)  # the first method on top
        handles, labels = axes[0].get_legend_handles_labels()
        if handles:
            fig.legend(handles, labels, loc="outside lower center", ncol=2, frameon=False)
        fig.suptitle(
            f"{title}: each method minus {' / '.join(references)} on the same base and seed\n"
            "mean and 95% interval (two-stage bootstrap over bases, then seeds)"
        )
    return fig


def claims(verdicts: list[Verdict], title: str) -> Figure:
    """One row per claim the grid ran (in the claims table's order): its verdict by the rule, and after Holm's
    correction across them; the claims whose methods the grid did not run are counted under the figure."""
    ran = [v for v in verdicts if v.verdict != "not run"]
    with _style():
        fig = _figure(8.0, 1.5 + 0.3 * max(len(ran), 2))
        ax = fig.subplots()
        for row, v in enumerate(ran):
            for col, word in enumerate((v.verdict, v.holm)):
                colour = VERDICT_COLOURS.get(word, "white")
                cell = Rectangle((col - 0.47, row - 0.42), 0.94, 0.84, facecolor=colour, gid=f"claim-{row}-{col}")
                ax.add_patch(cell)
                ax.text(col, row, word, ha="center", va="center", fontsize=8)
        ax.set_xlim(-0.5, len(COLUMNS) - 0.5)
        ax.set_ylim(max(len(ran), 1) - 0.5, -0.5)
        ax.set_yticks(range(len(ran)), [v.claim for v in ran], fontsize=8)
        ax.set_xticks(range(len(COLUMNS)), [COLUMNS[0], f"{COLUMNS[1]} ({len(ran)} claims)"])
        ax.xaxis.tick_top()
        ax.tick_params(length=0)
        for spine in ax.spines.values():
            spine.set_visible(False)
        if not ran:
            ax.text(0.5, 0.0, "no claim of the paper is run by this grid", ha="center", va="center")
        left_out = len(verdicts) - len(ran)
        notes = ["after Holm: a verdict whose null Holm's step-down across the claims does not reject is inconclusive"]
        if left_out:
            notes.append(f"{left_out} claim(s) whose methods the grid did not run are left out (tables.md lists them)")
        fig.suptitle("\n".join([f"{title}: the paper's claims, judged by rule", *notes]))
    return fig


def save(fig: Figure, path: Path) -> Path:
    """The figure as SVG at ``path``, written atomically, the same bytes for the same figure."""
    with _style(), atomic_path(path) as tmp:
        fig.savefig(tmp, format="svg", metadata=METADATA)
    return Path(path)


def write_figures(out: Path, title: str, differences: list[Difference], verdicts: list[Verdict]) -> list[Path]:
    """``forest.svg`` and ``claims.svg`` in ``out``; returns their paths."""
    return [save(forest(differences, title), Path(out) / FOREST), save(claims(verdicts, title), Path(out) / CLAIMS)]
