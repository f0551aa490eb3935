"""The report's figures against the shipped grids (docs/results/<grid>): the values a figure plots, read back
from its artists, are the paired differences computed here from results.json and the intervals and verdicts
the shipped tables.md states; a figure with a sign swapped or an interval dropped is caught by the same
reading; two renders are the same bytes."""

from __future__ import annotations

import functools
import json
import re
import statistics
from pathlib import Path

import pytest

from rpb.toyworld.grids import grids
from rpb.toyworld.study.across import differences
from rpb.toyworld.study.claims import judge
from rpb.toyworld.study.figures import Difference, claims, forest, write_figures
from rpb.toyworld.study.shipping import shipped_results, shipped_studies

GRIDS = grids()

RESULTS = Path(__file__).resolve().parents[3] / "docs" / "results"
#: each grid's reference arm, by the design in docs/toyworld.md: the beta grid has no sft, its beta-0 arm is sft
REFERENCES = {"headline": "sft", "beta": "rpb beta=0", "full": "sft"}
#: the tables round to 0.1 points
ROUNDING = 0.05 + 1e-9


@functools.cache
def _cells(name: str) -> list[dict]:
    grid = GRIDS[name]
    return [r for st in shipped_studies(grid, RESULTS / name) for r in shipped_results(st)]


# Each figure's data made from the grid's shipped cells as the report makes it, once per grid: the bootstrap
# behind it is most of these tests' time, so the forest plot is checked on beta (its own reference) and full (every
# method), the claims on headline (twelve run, Holm changing some) and beta (none run); the rest is pinned byte for
# byte by tests/project/test_shipped_results.py
@functools.cache
def _differences(name: str) -> list[Difference]:
    grid = GRIDS[name]
    return [d for s in grid.sets for d in differences(_cells(name), s, tuple(a.label for a in grid.arms))]


@functools.cache
def _verdicts(name: str) -> tuple:
    return tuple(judge(_cells(name), GRIDS[name].sets))


def _paired_means(name: str) -> dict[tuple[str, str, str], float]:
    """{(set, arm, metric): mean over (base, seed) of the arm's exact match minus the reference's, in points},
    straight from results.json."""
    cells = json.loads((RESULTS / name / "results.json").read_text())
    by = {(r["set"], r["arm"], r["base"], r["seed"]): r for r in cells}
    ref, pairs = REFERENCES[name], {}
    for (s, arm, base, seed), r in by.items():
        if arm != ref:
            for metric in ("id", "ood"):
                other = by[(s, ref, base, seed)]
                pairs.setdefault((s, arm, metric), []).append(100 * r[metric] - 100 * other[metric])
    return {k: statistics.fmean(v) for k, v in pairs.items()}


def _table_rows(name: str) -> dict[tuple[str, str, str], tuple[float, float, float]]:
    """{(set, arm, metric): (mean, lo, hi)} as the shipped tables.md prints them."""
    found, post_set = {}, None
    number = r"([+-]\d+\.\d) \[([+-]\d+\.\d), ([+-]\d+\.\d)\]"
    for line in (RESULTS / name / "tables.md").read_text().splitlines():
        heading = re.match(r"### (\w+): exact match", line)
        if heading or line.startswith("### "):
            post_set = heading.group(1) if heading else None
            continue
        cols = line.split(" | ")
        if post_set and line.startswith("| ") and len(cols) == 7:
            for metric, col in (("id", 2), ("ood", 5)):
                m = re.fullmatch(number, cols[col])
                if m:
                    found[(post_set, cols[0].removeprefix("| "), metric)] = tuple(map(float, m.groups()))
    return found


def _table_verdicts(name: str) -> list[tuple[str, str, str]]:
    """(claim, verdict, Holm-adjusted verdict) of every claim the shipped tables.md judged."""
    text = (RESULTS / name / "tables.md").read_text().split("### The paper's claims")[1]
    rows = [line.split(" | ") for line in text.splitlines() if line.startswith("| ") and " | " in line]
    return [(r[0].removeprefix("| "), r[4], r[5]) for r in rows[1:] if r[4] != "not run"]


def _by_gid(ax, gid: str) -> list:
    return [a for a in ax.get_children() if a.get_gid() == gid]


def _forest_mismatches(fig, means, rows) -> list[str]:
    """What the forest plot shows that differs from ``means`` (exact) and the tables' ``rows`` (to their
    rounding), read from its artists: each panel's set, each row's method, marker and interval line."""
    off, shown = [], set()
    for ax in fig.axes:
        post_set, arms = ax.get_title(), [t.get_text() for t in fig.axes[0].get_yticklabels()]
        if not _by_gid(ax, f"{post_set}-zero") or list(_by_gid(ax, f"{post_set}-zero")[0].get_xdata()) != [0, 0]:
            off.append(f"{post_set}: no line at zero")
        for metric in ("id", "ood"):
            (marks,) = _by_gid(ax, f"{post_set}-{metric}-mean")
            (lines,) = _by_gid(ax, f"{post_set}-{metric}-interval")
            ends = {round(seg[0][1], 6): (seg[0][0], seg[1][0]) for seg in lines.get_segments()}
            for x, y in zip(marks.get_xdata(), marks.get_ydata(), strict=True):
                arm = arms[round(y)]
                assert (y - round(y) < 0) == (metric == "id")  # ID above OOD in each row
                key = (post_set, arm, metric)
                shown.add(key)
                lo, hi = ends.pop(round(y, 6), (None, None))
                if key not in means or abs(x - means[key]) > 1e-9 or abs(x - rows[key][0]) > ROUNDING:
                    off.append(f"{key}: mean {x}")
                if lo is None or abs(lo - rows[key][1]) > ROUNDING or abs(hi - rows[key][2]) > ROUNDING:
                    off.append(f"{key}: interval {lo}, {hi}, the tables' {rows[key][1:]}")
            off += [f"{post_set} {metric}: an interval without a mean at y {y}" for y in ends]
    off += [f"{key}: not shown" for key in sorted(set(means) - shown)]
    return off


def _claims_shown(fig) -> list[tuple[str, str, str]]:
    (ax,) = fig.axes
    words = {(round(t.get_position()[0]), round(t.get_position()[1])): t.get_text() for t in ax.texts}
    names = [t.get_text() for t in ax.get_yticklabels()]
    return [(claim, words[(0, row)], words[(1, row)]) for row, claim in enumerate(names)]


@pytest.mark.parametrize("name", ["headline", "beta", "full"])
def test_the_forest_plot_shows_each_methods_paired_difference_and_interval(name):
    fig = forest(_differences(name), name)
    grid = GRIDS[name]
    assert [ax.get_title() for ax in fig.axes] == list(grid.sets)
    assert [t.get_text() for t in fig.axes[0].get_yticklabels()] == [
        a.label for a in grid.arms if a.label != REFERENCES[name]
    ]
    assert all(f"difference from {REFERENCES[name]}" in ax.get_xlabel() for ax in fig.axes)
    assert sorted(t.get_text() for t in fig.legends[0].get_texts()) == ["in-domain (ID)", "out-of-domain (OOD)"]
    assert _forest_mismatches(fig, _paired_means(name), _table_rows(name)) == []


@pytest.mark.parametrize("name", ["headline", "beta", "full"])
def test_the_claims_figure_shows_each_verdict_before_and_after_holm(name):
    expected = _table_verdicts(name)
    assert _claims_shown(claims(list(_verdicts(name)), name)) == expected
    if name == "headline":  # Holm turns some verdicts inconclusive: the two columns are not the same
        assert any(v != h for _, v, h in expected)
    if name == "beta":  # no claim's methods are in the beta grid
        assert expected == []


def _flipped(d: Difference) -> Difference:
    per_base = {b: [-v for v in vs] for b, vs in d.per_base.items()}
    return Difference(d.post_set, d.arm, d.metric, d.reference, per_base, -d.hi, -d.lo)


def test_a_swapped_sign_or_a_dropped_interval_is_caught():
    found, verdicts = _differences("full"), _verdicts("headline")
    means, rows = _paired_means("full"), _table_rows("full")
    assert _forest_mismatches(forest([_flipped(d) for d in found], "full"), means, rows)
    assert _forest_mismatches(forest(found[:3] + found[4:], "full"), means, rows)
    fig = forest(found, "full")
    (lines,) = _by_gid(fig.axes[1], f"{fig.axes[1].get_title()}-ood-interval")
    lines.set_segments(lines.get_segments()[1:])
    assert _forest_mismatches(fig, means, rows)
    # the verdict and Holm columns swapped
    swapped = [v.__class__(**{**v.__dict__, "verdict": v.holm, "holm": v.verdict}) for v in verdicts]
    assert _claims_shown(claims(swapped, "headline")) != _table_verdicts("headline")


def test_two_renders_are_the_same_bytes(tmp_path):
    found, verdicts = _differences("full"), list(_verdicts("headline"))
    first = write_figures(tmp_path / "a", "Grid `full`", found, verdicts)
    second = write_figures(tmp_path / "b", "Grid `full`", found, verdicts)
    assert [p.name for p in first] == ["forest.svg", "claims.svg"]
    for a, b in zip(first, second, strict=True):
        assert a.read_bytes() == b.read_bytes()
        assert b"<dc:date>" not in a.read_bytes() and b"Matplotlib v" not in a.read_bytes()
