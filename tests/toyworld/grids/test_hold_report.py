"""The hold grid's report on hand-made cells: its tables read the cells' own figures (means by hand), the revert
table takes the retrained sft cells in place of the copied ones, and the figures are written."""

from __future__ import annotations

import dataclasses
import json
from types import SimpleNamespace

import pytest

from rpb.toyworld.grids.hold import GRID, report_hold
from rpb.toyworld.world.generators import DOMAINS
from tests.toyworld.grids.test_hold import cells


def revert_entry(delta: float, post: float, back: float) -> dict:
    variant = lambda o: {"nll": 1.0, "exact_match": 0.5, "topk_overlap": o}  # noqa: E731
    entry = {"rows": 10, "variants": {"post": variant(post), "post+base routers": variant(back)},
             "delta_nll": delta, "delta_nll_ci": [delta - 0.01, delta + 0.01]}  # fmt: skip
    return {d: entry for d in ("math_post", *DOMAINS)}


def study(tmp_path, base: int, retrained: list[dict]):
    out = tmp_path / f"base{base}"
    for r in retrained:
        where = out / "revert" / r["set"] / "sft" / f"seed{r['seed']}"
        where.mkdir(parents=True)
        (where / "result.json").write_text(json.dumps(r))
    facts = {"seed": base, "heldout_exact_match": {d: 0.8 for d in DOMAINS}, "modularity": 0.1, "communities": 3.0,
             "between_domain_jsd_bits": 0.02, "weights_sha256": "ab" * 32}  # fmt: skip
    return SimpleNamespace(out=out, base_seed=base, base_facts=lambda: facts, selected_keys=list)


def test_the_report_reads_the_cells_and_the_retrained_sft_cells(tmp_path):
    results = cells({"routing-kd": {"topk_overlap": 0.2}})
    for r in results:
        r["threads"], r["machine"], r["torch"] = 1, "cpu", "2.13.0"
        if r["arm"] == "routing-kd":
            r["revert"] = revert_entry(0.02, 0.7, 0.71)
    retrained = [dict(r, revert=revert_entry(0.05 + 0.01 * r["base"], 0.5, 0.53)) for r in results if r["arm"] == "sft"]
    studies = [study(tmp_path, b, [r for r in retrained if r["base"] == b]) for b in (0, 1, 2)]
    grid = dataclasses.replace(GRID, sets=("math_post",))
    tables = report_hold(grid, studies, results, tmp_path / "report")
    routing = [r["retention"]["topk_overlap"] for r in results if r["arm"] == "routing-kd"]
    assert "| routing-kd | 9 |" in tables
    assert f"{sum(routing) / 9:.3f} ±" in tables
    # the revert table: the retrained sft cells (9: 0.05, 0.06, 0.07 on the three bases), not the copied ones
    assert "| sft | 9 | 0.0600 ±" in tables and "| routing-kd | 9 | 0.0200 ±" in tables
    assert "9 retrained `sft` cells against the copied ones: 18 of 18 exact-match figures equal" in tables
    assert "(1) routing-kd keeps top-k overlap" in tables
    for name in ("tables.md", "results.json", "bases.json", "hold.svg", "forest.svg", "claims.svg"):
        assert (tmp_path / "report" / name).is_file(), name
    assert len(json.loads((tmp_path / "report" / "results.json").read_text())) == len(results)
    assert pytest.approx(0.2, abs=0.02) == sum(routing) / 9 - 0.5


def test_the_claims_are_judged_again_against_the_retrained_sft_cells():
    from rpb.toyworld.grids.hold import judge_hold
    from rpb.toyworld.grids.hold_report import against_retrained

    # the copied sft cells keep the routing as routing-kd does; the retrained ones do not: claim (1) turns
    results = cells({"routing-kd": {"topk_overlap": 0.3}, "sft": {"topk_overlap": 0.3}})
    retrained = [dict(r, retention={"topk_overlap": r["retention"]["topk_overlap"] - 0.3}, arm="sft")
                 for r in results if r["arm"] == "sft"]  # fmt: skip
    assert "(1)" not in [v.claim[:3] for v in judge_hold(results, ("math_post",)) if v.verdict == "reproduces"]
    said = against_retrained(results, retrained, judge_hold, ("math_post",))
    assert "9 of 9 `sft` cells replaced" in said
    row = next(line for line in said.splitlines() if "(1) routing-kd keeps top-k overlap" in line)
    assert "reproduces" in row
    assert against_retrained(results, [], judge_hold, ("math_post",)) == ""
    assert "1 of 9" in against_retrained(results, retrained[:1], judge_hold, ("math_post",))
