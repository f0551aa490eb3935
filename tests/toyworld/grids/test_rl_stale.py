"""The rl-stale grid's claims on hand-made cells (each verdict follows from differences built to give it), its
collapse claim against a hypergeometric tail computed here, and its arms as the issue lists them."""

from __future__ import annotations

import json
from math import comb
from pathlib import Path

import pytest

from rpb.toyworld.grids.rl_stale import BETA, GRID, PILOT, PLAIN, PR2_SCALES, PRESSURES, fisher_more, judge_rl_stale

BASES, SEEDS = (0, 1, 2), (42, 43, 44)
ARMS = [a.label for a in GRID.arms]


def cells(shift: dict[str, dict[str, float]], collapsed: dict[str, int] | None = None) -> list[dict]:
    """Every arm on 3 bases x 3 seeds: common figures plus ``shift[arm][metric]``, a small seeded spread; the first
    ``collapsed[arm]`` cells of an arm collapsed."""
    out = []
    for arm in ARMS:
        for i, (b, s) in enumerate((b, s) for b in BASES for s in SEEDS):
            wobble = ((b * 7 + s * 3) % 5 - 2) * 0.005
            f = {"id": 50.0, "ood": 25.0, "start_topk_overlap": 0.8, "stale_mismatch": 0.2, "logp_gap": 0.02}
            f = {
                k: v + shift.get(arm, {}).get(k, 0.0) + wobble * (10 if k in ("id", "ood") else 0.01)
                for k, v in f.items()
            }
            summary = {"collapsed": i < (collapsed or {}).get(arm, 0)}
            retention = {k: f[k] for k in ("start_topk_overlap", "stale_mismatch", "logp_gap")}
            out.append({"set": "math_post", "arm": arm, "base": b, "seed": s, "id": f["id"] / 100,
                        "ood": f["ood"] / 100, "retention": retention, "rl": {"summary": summary}})  # fmt: skip
    return out


def by_number(verdicts):
    return {v.claim.split(" ")[0]: v.verdict for v in verdicts}


def test_the_arms_are_the_issues_at_the_pilots_pressure():
    assert ARMS == ["grpo", "grpo + R2", "grpo + R3", "grpo + PR2", "gspo", "grpo + beta", "grpo + beta + routing-kd"]
    iterations = {dict(a.trl)["num_iterations"] for a in GRID.arms}
    assert len(iterations) == 1  # every arm at the same off-policy pressure
    assert [dict(a.trl).get("beta", 0.0) for a in GRID.arms][-2:] == [BETA, BETA]
    assert {a.replay for a in GRID.arms} == {"off", "R2", "R3", "PR2"}


def test_each_claim_reproduces_where_the_cells_say_so():
    shift = {
        "grpo + PR2": {"stale_mismatch": -0.1, "id": 2.0},
        "grpo + R3": {"logp_gap": -0.01},
        "gspo": {"id": 0.5},
        "grpo + beta + routing-kd": {"start_topk_overlap": 0.1},
    }
    got = by_number(judge_rl_stale(cells(shift, {PLAIN: 7})))
    assert got == {"(1)": "reproduces", "(3)": "reproduces", "(4)": "reproduces", "(5)": "reproduces",
                   "(6)": "reproduces", "(2)": "reproduces"}  # fmt: skip
    assert [v.holm for v in judge_rl_stale(cells(shift, {PLAIN: 7}))][-1] == "outside Holm"


def test_the_opposite_cells_contradict_and_nothing_collapsed_is_inconclusive():
    shift = {
        "grpo + PR2": {"stale_mismatch": 0.1, "id": -2.0},
        "grpo + R3": {"logp_gap": 0.01},
        "gspo": {"id": 10.0},
        "grpo + beta + routing-kd": {"start_topk_overlap": -0.1},
    }
    got = by_number(judge_rl_stale(cells(shift)))
    assert got == {"(1)": "contradicted", "(3)": "contradicted", "(4)": "inconclusive", "(5)": "contradicted",
                   "(6)": "contradicted", "(2)": "contradicted"}  # fmt: skip


@pytest.mark.parametrize("a, b", [(5, 0), (4, 1), (3, 3), (9, 2)])
def test_the_collapse_claim_is_fishers_one_sided_tail(a, b):
    n = m = 9
    # P(X >= a) for X the plain arm's collapses among a + b, drawn without replacement from 9 + 9 cells
    k = a + b
    tail = sum(comb(n, x) * comb(m, k - x) for x in range(a, min(n, k) + 1)) / comb(n + m, k)
    v = fisher_more("(4)", (a, n), (b, m))
    assert v.p == pytest.approx(tail, rel=1e-12)
    assert v.verdict == ("reproduces" if tail < 0.05 else "inconclusive")


def test_the_grid_takes_the_shipped_pilots_choices_by_the_pilots_own_rule():
    shipped = json.loads((Path(__file__).resolve().parents[3] / "docs/results/rl-stale/pilot.json").read_text())
    plain = shipped["plain_stale_mismatch"]
    names = [f"plain-{u}x{i}-lr{lr:g}" for u, i, lr in PRESSURES]
    first = next(p for p, name in zip(PRESSURES, names, strict=True) if plain[name] >= 2 * plain["rl recipe"])
    scales = shipped["pr2_stale_mismatch"]
    assert tuple(shipped["pressure"]) == first == PILOT["pressure"]
    assert float(min(scales, key=scales.get)) == shipped["pr2_lr_scale"] == PILOT["pr2_lr_scale"]
    assert set(scales) == {f"{s:g}" for s in PR2_SCALES}
    updates, iterations, lr = first
    assert (GRID.recipe.steps_per_generation, GRID.recipe.lr) == (updates, lr)
    assert dict(GRID.arms[3].trl) == {"num_iterations": iterations, "pr2_lr_scale": PILOT["pr2_lr_scale"]}
