"""The hold-stored grid's report on hand-made cells: each form's bytes per token against a hand product, the
windows' first and last values, a weight at an end of its candidates flagged, claim 1's check against the hold
grid's own online cells, and every table and figure written."""

from __future__ import annotations

import dataclasses
import json
from types import SimpleNamespace

import numpy as np

from rpb.toyworld.grids.hold_stored import GRID, STORED_ARMS, report_hold_stored
from rpb.toyworld.grids.hold_stored_report import storage_table, windows_table
from rpb.toyworld.world.generators import DOMAINS

ARMS = tuple(a.label for a in STORED_ARMS)
#: each arm's OOD and overlap in the hand-made cells
OOD = {"sft": 20, "routing-kd": 35, "routing-kd routes": 22, "stored top-k": 34, "stored top-2k": 35,
       "stored ids hinge": 30, "routing-kd-router": 21, "hidden-kd": 33}  # fmt: skip


def cells(seed: int = 0) -> list[dict]:
    rng = np.random.default_rng(seed)
    out = []
    for arm in ARMS:
        for base in (0, 1, 2):
            for s in (42, 43, 44):
                weighted = arm not in ("sft", "routing-kd", "routing-kd routes")  # the copies carry no windows
                hinge = [0.1, 0.4] if arm == "stored ids hinge" else [None, None]
                out.append({
                    "arm": arm, "set": "code_post", "base": base, "seed": s, "id": 0.6 + 0.01 * rng.standard_normal(),
                    "ood": (OOD[arm] + rng.standard_normal()) / 100,
                    "retention": {"topk_overlap": 0.8 + OOD[arm] / 1000, "tvd": 0.1, "nmi": 0.5},
                    **({"windows": {"step": [10, 500], "anchor_loss": [0.001, 0.02 + s / 1e4],
                                    "routes_hinge_active": hinge}} if weighted else {}),
                    "threads": 1, "machine": "Xeon" if arm == "routing-kd routes" else "EPYC", "torch": "2.13.0",
                })  # fmt: skip
    return out


def test_each_forms_bytes_per_token_is_the_hand_product_at_both_shapes():
    table = storage_table(cells(), ("code_post",), ARMS, (4, 6, 64))
    # 8 bytes of token id, then per layer an int16 per stored expert, and a float32 beside each with probabilities
    here = {"ids alone": 8 + 4 * 6 * 2, "top-k with probabilities": 8 + 4 * 6 * 6, "top-2k": 8 + 4 * 12 * 6}
    moon = {"ids alone": 8 + 27 * 6 * 2, "top-k with probabilities": 8 + 27 * 6 * 6, "top-2k": 8 + 27 * 12 * 6}
    assert f"| stored ids hinge | ids alone | {here['ids alone']} | {moon['ids alone']} | 29.9 ± 1.1 | 0.830 " in table
    assert f"| stored top-k | top-k with probabilities | {here['top-k with probabilities']} | 980 |" in table
    assert moon["top-k with probabilities"] == 980
    assert f"| stored top-2k | top-2k with probabilities | {here['top-2k']} | {moon['top-2k']} |" in table
    assert "| routing-kd | the base's forward, online" in table and "| sft |" not in table


def test_the_windows_table_reads_each_cells_first_and_last_window():
    table = windows_table(cells(), ARMS)
    # the last window's term is 0.02 + seed / 1e4: 0.0243 on average over seeds 42-44, sd 0.0001
    hinge = "| 0.1000 ± 0.0000 | 0.4000 ± 0.0000 |"
    assert f"| code_post | stored ids hinge | 9 | 0.0010 ± 0.0000 | 0.0243 ± 0.0001 {hinge}" in table
    assert "| code_post | stored top-k | 9 | 0.0010 ± 0.0000 | 0.0243 ± 0.0001 | n/a | n/a |" in table
    assert "| sft |" not in table and "| routing-kd |" not in table


def study(tmp_path, base: int, chosen: float):
    out = tmp_path / f"base{base}"
    out.mkdir(parents=True)
    keys = sorted(GRID.candidates)
    (out / "selection.json").write_text(json.dumps({"criterion": "mean of ID and OOD exact match",
                                                    "chosen": dict.fromkeys(keys, chosen)}))  # fmt: skip
    facts = {"seed": base, "heldout_exact_match": {d: 0.8 for d in DOMAINS}, "modularity": 0.1, "communities": 3.0,
             "between_domain_jsd_bits": 0.02, "weights_sha256": "ab" * 32}  # fmt: skip
    return SimpleNamespace(out=out, base_seed=base, base_facts=lambda: facts, selected_keys=lambda: keys)


def test_the_report_writes_its_tables_and_figures_and_flags_a_weight_at_an_end(tmp_path):
    results = cells()
    studies = [study(tmp_path, b, chosen) for b, chosen in ((0, 100.0), (1, 1.0), (2, 0.01))]
    grid = dataclasses.replace(GRID, sets=("code_post",))
    tables = report_hold_stored(grid, studies, results, tmp_path / "report")
    assert "(1b) stored top-k − online > −8.2 points (code_post, OOD)" in tables
    assert "12 of 18 choices at an end of their candidates." in tables  # 6 selections at 100 (base 0), 0.01 (base 2)
    assert "routing-kd routes: Xeon (9)" in tables and "stored top-k: EPYC (9)" in tables
    assert "(1a) against hold's online cells, overlap ±0.05 (code_post)" in tables
    for name in ("tables.md", "results.json", "hold.svg", "forest.svg", "claims.svg"):
        assert (tmp_path / "report" / name).is_file(), name
