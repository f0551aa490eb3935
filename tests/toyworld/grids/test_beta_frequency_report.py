"""The frequency grid's report on hand-made cells: the tables' figures against hand computations, the claims, the
files and figures it writes."""

from __future__ import annotations

import json
import statistics
from types import SimpleNamespace

import pytest

from rpb.toyworld.grids.beta_frequency import GRID as FREQUENCY_GRID
from rpb.toyworld.grids.beta_frequency import (
    differences,
    frequency_label,
    probability_label,
    report_frequency,
    scores_table,
)


def cells() -> list[dict]:
    """Probability cells at 40% ID / 20% OOD; frequency cells shifted by +2 ID and -1 OOD at beta 1 and by seed-
    dependent amounts at beta 0.25 (known means), with routing figures."""
    out = []
    for base in (0, 1, 2):
        for post_set in FREQUENCY_GRID.sets:
            for seed, shift in zip((42, 43, 44), (-1.0, 0.0, 1.0), strict=True):
                for beta, (d_id, d_ood) in ((0.25, (shift, shift / 2)), (1.0, (2.0, -1.0))):
                    common = {"base": base, "set": post_set, "seed": seed, "method": "rpb", "machine": "m",
                              "threads": 1, "retention": {"topk_overlap": 0.9, "tvd": 0.1, "nmi": 0.5},
                              "mechanism": {"start_displacement": 0.1, "bias_changed": 0.0, "overlap_base": 0.8,
                                            "overlap_prior": 0.5}}  # fmt: skip
                    out.append({**common, "arm": probability_label(beta), "id": 0.40, "ood": 0.20})
                    out.append({**common, "arm": frequency_label(beta), "id": 0.40 + d_id / 100,
                                "ood": 0.20 + d_ood / 100})  # fmt: skip
    return out


def facts(seed: int) -> dict:
    return {"seed": seed, "heldout_exact_match": {"math": 0.5}, "modularity": 0.3, "communities": 4.0,
            "between_domain_jsd_bits": 0.2, "weights_sha256": "ab" * 32}  # fmt: skip


def test_scores_and_differences_are_the_hand_means():
    results = cells()
    text = scores_table(results, FREQUENCY_GRID.sets)
    row = next(line for line in text.splitlines() if line.startswith("| 1 | both |"))
    assert "40.0 ± 0.0" in row and "42.0 ± 0.0" in row and "+2.0 [+2.0, +2.0]" in row and "-1.0 [-1.0, -1.0]" in row
    row = next(line for line in text.splitlines() if line.startswith("| 0.25 | math_post |"))
    values = [39.0, 40.0, 41.0] * 3  # three bases alike
    assert f"{statistics.fmean(values):.1f} ± {statistics.stdev(values):.1f}" in row and "+0.0 [" in row
    found = differences(results)
    assert len(found) == 2 * len(FREQUENCY_GRID.sets) * 2
    beta1_id = [d for d in found if d.arm == frequency_label(1.0) and d.metric == "id"]
    assert all(d.mean == pytest.approx(2.0) for d in beta1_id)


def test_the_report_writes_its_files(tmp_path):
    studies = [SimpleNamespace(base_seed=b, base_facts=lambda b=b: facts(b)) for b in (0, 1, 2)]
    tables = report_frequency(FREQUENCY_GRID, studies, cells(), tmp_path)
    assert (tmp_path / "tables.md").read_text() == tables
    assert len(json.loads((tmp_path / "results.json").read_text())) == 72
    assert (tmp_path / "forest.svg").is_file() and (tmp_path / "claims.svg").is_file()
    claims = [line for line in tables.splitlines() if line.startswith("| frequency ≈ probability")]
    assert len(claims) == 8
    # beta 1 ID: +2 points everywhere, inside ±6.5, outside ±1 with no spread
    assert any("beta 1, ID, margin ±6.5" in line and "| reproduces |" in line for line in claims)
    assert any("beta 1, ID, margin ±1 |" in line and "| contradicted |" in line for line in claims)
    assert "this grid can find only large in-domain differences" in tables
