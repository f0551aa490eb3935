"""The hold-target grid's report on hand-made cells: the acceptance check read from each cell's trajectory (the
last steps' mean by hand), the OOD at sft's mean ID against scikit-learn's least squares on the same design, and
every table and figure written."""

from __future__ import annotations

import dataclasses
import json
from types import SimpleNamespace

import numpy as np
import pytest
from sklearn.linear_model import LinearRegression

from rpb.toyworld.grids.hold_target import GRID, MATCHED, TARGET_ARMS, report_hold_target
from rpb.toyworld.grids.hold_target_report import LAMBDA_MAX, acceptance_table, adjusted_ood, tail_overlap
from rpb.toyworld.world.generators import DOMAINS

ARMS = tuple(a.label for a in TARGET_ARMS)
#: each arm's true intercept (OOD points at ID 0) in the hand-made cells, and the common slope of OOD on ID
INTERCEPT = {"sft": 40.0, "routing-kd": 55.0, "target 0.70": 48.0, "target 0.80": 50.0, "target 0.90": 53.0,
             "target matched": 54.0}  # fmt: skip
SLOPE = -0.5


def trajectory(target: float | None, end: float, lam: float, steps: int = 500) -> dict:
    windows = list(range(10, steps + 1, 10))
    m = [1.0 if s <= 100 else end for s in windows]
    return {"step": windows, "overlap": m, "overlap_min": m, "lambda": [None if target is None else lam] * len(windows),
            "max_steps": steps}  # fmt: skip


def cells(seed: int = 0) -> list[dict]:
    rng = np.random.default_rng(seed)
    out = []
    for arm in ARMS:
        for base in (0, 1, 2):
            for s in (42, 43, 44):
                target = {"target 0.70": 0.7, "target 0.80": 0.8, "target 0.90": 0.9}.get(arm)
                target = MATCHED[(base, "code_post")] if arm == "target matched" else target
                id_ = 60 + 10 * rng.standard_normal()
                ood = INTERCEPT[arm] + SLOPE * id_ + rng.standard_normal()
                out.append({
                    "arm": arm, "set": "code_post", "base": base, "seed": s, "id": id_ / 100, "ood": ood / 100,
                    "anchor": {} if target is None else {"target": target},
                    "retention": {"topk_overlap": 0.7, "tvd": 0.1, "nmi": 0.5},
                    "mechanism": {"overlap_base": target or 0.6},
                    "hold": trajectory(target, (target or 0.6) + 0.01, 5.0),
                    "threads": 1, "machine": "cpu", "torch": "2.13.0",
                })  # fmt: skip
    return out


def test_the_last_steps_mean_is_read_from_the_windows_after_80_percent():
    hold = {"step": [100, 400, 410, 500], "overlap": [0.1, 0.2, 0.5, 0.7], "max_steps": 500}
    assert tail_overlap({"hold": hold}, 0.2) == pytest.approx(0.6)  # steps 410 and 500: after step 400
    assert tail_overlap({"hold": {"step": [], "overlap": []}}, 0.2) is None


def test_the_acceptance_check_lists_every_target_cell_and_names_those_at_lambda_max():
    mine = [
        {"set": "math_post", "arm": "target 0.80", "seed": 42, "anchor": {"target": 0.8},
         "hold": trajectory(0.8, 0.82, 3.0)},
        {"set": "math_post", "arm": "target 0.90", "seed": 42, "anchor": {"target": 0.9},
         "hold": trajectory(0.9, 0.84, LAMBDA_MAX)},
        {"set": "math_post", "arm": "sft", "seed": 42, "anchor": {}, "hold": trajectory(None, 0.5, 0.0)},
    ]  # fmt: skip
    table = acceptance_table(mine, 0.03, 0.2)
    assert "1 of 2 cells inside the band." in table
    assert "| math_post | target 0.80 | 0 | 42 | 0.800 | 0.820 | yes | 3 | 3 |" in table
    assert "| 0.840 | **no** | 1e+03 | 1e+03 **at λ_max** |" in table
    assert "| sft |" not in table


def test_the_ood_at_sfts_mean_id_is_sklearns_fit_with_one_intercept_per_arm():
    results = cells()
    fit = adjusted_ood(results, "code_post", ARMS, resamples=200)
    X = np.array([[100 * r["id"]] + [float(r["arm"] == a) for a in ARMS] for r in results])
    y = np.array([100 * r["ood"] for r in results])
    reg = LinearRegression().fit(X, y)
    at = np.mean([100 * r["id"] for r in results if r["arm"] == "sft"])
    for i, arm in enumerate(ARMS):
        row = np.array([[at] + [float(j == i) for j in range(len(ARMS))]])
        assert fit[arm]["ood"] == pytest.approx(float(reg.predict(row)[0]), abs=1e-9), arm
        lo, hi = fit[arm]["ci"]
        assert lo <= fit[arm]["ood"] <= hi
    # the hand-made truth: the arms' OOD at the same ID differ by their intercepts, within the noise
    assert fit["routing-kd"]["ood"] - fit["sft"]["ood"] == pytest.approx(15.0, abs=1.5)
    assert fit["_resamples"] == 200


def study(tmp_path, base: int, controls: list[dict]):
    out = tmp_path / f"base{base}"
    for r in controls:
        where = out / "sigmoid" / r["set"] / f"seed{r['seed']}"
        where.mkdir(parents=True)
        (where / "result.json").write_text(json.dumps(r))
    facts = {"seed": base, "heldout_exact_match": {d: 0.8 for d in DOMAINS}, "modularity": 0.1, "communities": 3.0,
             "between_domain_jsd_bits": 0.02, "weights_sha256": "ab" * 32}  # fmt: skip
    return SimpleNamespace(out=out, base_seed=base, base_facts=lambda: facts, selected_keys=list)


def test_the_report_writes_its_tables_and_figures(tmp_path):
    results = cells()
    controls = [dict(r, arm="target 0.80 sigmoid") for r in results if r["arm"] == "target 0.80" and r["base"] == 0]
    studies = [study(tmp_path, b, controls if b == 0 else []) for b in (0, 1, 2)]
    grid = dataclasses.replace(GRID, sets=("code_post",))
    tables = report_hold_target(grid, studies, results, tmp_path / "report")
    assert "| target 0.90 | 9 |" in tables and "(2) target 0.90 > target 0.70 (code_post, OOD)" in tables
    assert "39 of 39 cells inside the band." in tables  # 4 target arms x 9 cells, and base 0's 3 controls
    assert tables.count("| sigmoid |") == 3 and tables.count("| softmax |") == 3  # base 0's pairs, seed by seed
    for name in ("tables.md", "results.json", "overlap.svg", "tradeoff.svg", "lambda.svg", "forest.svg", "claims.svg"):
        assert (tmp_path / "report" / name).is_file(), name
