"""The rl grid's figure: its curves and points read back from the artists against hand computations on the
miniature grid's cells, and the same cells drawn to the same bytes."""

import numpy as np
import pytest
from scipy import stats

from rpb.toyworld.study.figures import save
from rpb.toyworld.study.rl_figures import (
    WINDOW,
    band,
    final_reward,
    has_stale_by_update,
    logged,
    rl_figure,
    running_mean,
    stale_figure,
)


def test_the_helpers_against_hand_values():
    assert logged([None, 0.5, None, 0.25]) == ([2, 4], [0.5, 0.25])
    assert running_mean([1.0, 3.0, 5.0, 7.0], window=2) == [1.0, 2.0, 4.0, 6.0]
    assert final_reward({"rl": {"reward": [None, *([0.0] * 19), 1.0, None]}}) == pytest.approx(0.5)
    mean, lo, hi = band([[1.0, 2.0], [3.0, 6.0], [2.0, 1.0]])
    assert mean.tolist() == pytest.approx([2.0, 3.0])
    t_lo, t_hi = stats.t.interval(0.95, 2, loc=3.0, scale=stats.sem([2.0, 6.0, 1.0]))
    assert (lo[1], hi[1]) == pytest.approx((t_lo, t_hi))
    assert band([[1.0, 2.0, 3.0]])[1].tolist() == [1.0, 2.0, 3.0]  # one cell: no interval


def _artist(fig, gid):
    found = [a for ax in fig.get_axes() for a in [*ax.lines, *ax.collections] if a.get_gid() == gid]
    assert len(found) == 1, gid
    return found[0]


def test_the_figure_draws_each_arms_cells(rl_finished, tmp_path):
    _, results = rl_finished
    fig = rl_figure(results, "mini")
    for arm in ("grpo", "grpo + R3"):
        cells = [r for r in results if r["arm"] == arm]
        # R3 logs its override rate, not a flip rate (docs/rl.md): no flip-rate curve is drawn for it
        for key in ("reward", "rollout_flip_rate") if arm != "grpo + R3" else ("reward",):
            curves = []
            for r in cells:
                values = [v for v in r["rl"][key] if v is not None]
                curves.append([np.mean(values[max(0, i + 1 - WINDOW) : i + 1]) for i in range(len(values))])
            line = _artist(fig, f"{key}-{arm}-mean")
            assert line.get_ydata() == pytest.approx(np.mean(curves, axis=0))
        points = _artist(fig, f"cells-{arm}")
        finals = []
        for r in cells:
            rewards = [v for v in r["rl"]["reward"] if v is not None]
            finals.append(np.mean(rewards[-max(1, len(rewards) // 10) :]))
        drawn = sorted(zip(points.get_xdata(), points.get_ydata(), strict=True))
        expected = sorted(zip(finals, [r["retention"]["start_topk_overlap"] for r in cells], strict=True))
        np.testing.assert_allclose(np.array(drawn, dtype=float), np.array(expected, dtype=float))
    a, b = save(fig, tmp_path / "a.svg"), save(rl_figure(results, "mini"), tmp_path / "b.svg")
    assert a.read_bytes() == b.read_bytes()


def test_the_stale_figure_draws_each_arms_mean_per_update_index(tmp_path):
    by_update = {"grpo": [{"1": 0.1, "2": 0.3}, {"1": 0.2, "2": 0.5}], "grpo + PR2": [{"1": 0.05, "2": 0.1},
                 {"1": 0.15, "2": 0.3}, {"1": 0.1, "2": 0.2}]}  # fmt: skip
    results = [
        {"arm": arm, "rl": {"stale_mismatch_by_update": cell}} for arm, cells in by_update.items() for cell in cells
    ]
    results.append({"arm": "old", "rl": {}})  # a cell from before issue 64: nothing drawn for it
    assert has_stale_by_update(results) and not has_stale_by_update([{"arm": "old", "rl": {}}])
    fig = stale_figure(results, "mini")
    for arm, cells in by_update.items():
        assert _artist(fig, f"stale-{arm}").get_ydata() == pytest.approx([np.mean([c[i] for c in cells]) for i in "12"])
    a, b = save(fig, tmp_path / "a.svg"), save(stale_figure(results, "mini"), tmp_path / "b.svg")
    assert a.read_bytes() == b.read_bytes()
