"""The rl grid's report on the miniature grid's cells: its tables against hand computations, its claims judged
(the arms it did not run: not run), and its files."""

import json
import statistics

import numpy as np
import pytest

from rpb.toyworld.grids.rl import CLAIM_PAIRS
from rpb.toyworld.study.rl import RLGrid
from rpb.toyworld.study.rl_report import report_rl, scores_table
from rpb.toyworld.study.stats import minimal_detectable_difference


def _section(tables: str, start: str) -> list[list[str]]:
    body = tables.split(f"### {start}", 1)[1].split("\n### ", 1)[0]
    return [[c.strip() for c in ln.strip("|").split("|")] for ln in body.splitlines() if ln.startswith("| ")][1:]


@pytest.fixture(scope="module")
def reported(rl_finished, tmp_path_factory):
    study, results = rl_finished
    out = tmp_path_factory.mktemp("report")
    return study, results, out, report_rl(study.grid, [study], results, out)


def test_the_scores_table_is_the_cells_means_and_paired_differences(reported):
    _, results, _, tables = reported
    rows = {r[0]: r for r in _section(tables, "math_post: exact match")}
    assert list(rows) == ["grpo", "grpo + lbl", "grpo + R3"]
    for arm, row in rows.items():
        cells = sorted((r for r in results if r["arm"] == arm), key=lambda r: r["seed"])
        ids = [100 * r["id"] for r in cells]
        assert row[1] == f"{statistics.fmean(ids):.1f} ± {statistics.stdev(ids):.1f}"
        assert row[-1] == f"{sum(r['rl']['summary']['collapsed'] for r in cells)} of {len(cells)}"
        # under 20 logged rewards, a cell's final reward is its last
        finals = [[v for v in r["rl"]["reward"] if v is not None][-1] for r in cells]
        assert row[-2] == f"{statistics.fmean(finals):.3f} ± {statistics.stdev(finals):.3f}"
        facts = [100 * r["per_domain"]["facts"] for r in cells]
        assert row[8] == f"{statistics.fmean(facts):.1f} ± {statistics.stdev(facts):.1f}"
        if arm != "grpo":
            plain = sorted((r for r in results if r["arm"] == "grpo"), key=lambda r: r["seed"])
            diff = np.mean([100 * (a["ood"] - b["ood"]) for a, b in zip(cells, plain, strict=True)])
            assert row[4].startswith(f"{diff:+.1f} [")
        else:
            assert row[2] == row[4] == ""


def test_the_routing_table_and_the_detectable_differences(reported):
    _, results, _, tables = reported
    routing = {r[0]: r for r in _section(tables, "Routing")}
    r3 = [r for r in results if r["arm"] == "grpo + R3"]
    overlap = [r["retention"]["start_topk_overlap"] for r in r3]
    # the flip rate ("—" for R3, which logs none), then R3's override rate where cells record it ("—" for the arms
    # that log a flip rate), then the stale mismatch where they record it
    override = [r["retention"]["override_rate"] for r in r3]
    assert routing["grpo + R3"][2] == f"{statistics.fmean(override):.3f} ± {statistics.stdev(override):.3f}"
    assert routing["grpo + R3"][1] == "—" and routing["grpo"][2] == "—"
    stale = [r["retention"]["stale_mismatch"] for r in r3]
    assert routing["grpo + R3"][3] == f"{statistics.fmean(stale):.3f} ± {statistics.stdev(stale):.3f}"
    assert routing["grpo + R3"][5] == f"{statistics.fmean(overlap):.3f} ± {statistics.stdev(overlap):.3f}"
    detectable = {r[0]: r for r in _section(tables, "What the grid could detect")}
    # claim 2 compares flip rates, which R3's cells no longer record: no pairs, no row
    assert set(detectable) == {"3", "8"}, "the pairs of the arms the grid ran"
    by = {(r["arm"], r["seed"]): r["retention"]["logp_gap"] for r in results}
    diffs = [by[("grpo + R3", s)] - by[("grpo", s)] for s in (42, 43)]
    sd = float(np.std(diffs, ddof=1))
    assert detectable["8"][3:] == ["2", f"{sd:.3g}", f"{minimal_detectable_difference(sd, 2):.3g}"]
    assert {c[0] for c in CLAIM_PAIRS} >= set(detectable)


def test_the_claims_the_arms_allow_are_judged_and_the_files_written(reported):
    study, results, out, tables = reported
    claims = {r[0].split(".")[0]: r for r in _section(tables, "The claims, judged by rule")}
    assert {k for k, r in claims.items() if r[4] != "not run"} == {"1", "3", "8"}
    assert claims["4"][4] == claims["8b"][4] == "not run"
    assert claims["2"][4] == "not run"  # R3's cells record its override rate, not a flip rate (docs/rl.md)
    assert f"| 0 | 42 | {study.start_record()['weights_sha256'][:12]} |" in tables
    assert "| base 0 | lbl |" in tables.split("### Weights chosen per base", 1)[1]
    shipped = json.loads((out / "results.json").read_text())
    assert len(shipped) == len(results) and all(set(c["rl"]) == {"summary", "arm", "seed", "settings", "seconds"}
                                                for c in shipped)  # fmt: skip
    assert (out / "rl.svg").is_file() and (out / "claims.svg").is_file() and (out / "tables.md").read_text() == tables
    assert (out / "stale.svg").is_file() and "(stale.svg)" in tables  # the cells record the mismatch per update
    assert isinstance(study.grid, RLGrid)


def test_a_difference_is_the_arm_minus_plain_grpo_on_the_same_seed(rl_finished):
    """Cells whose scores differ by hand-set amounts (the miniature's barely move): 5 and 10 points above plain
    GRPO's out of domain, on seeds 42 and 43."""
    _, results = rl_finished
    plain = {r["seed"]: r for r in results if r["arm"] == "grpo"}
    moved = [r | {"ood": plain[r["seed"]]["ood"] + 0.05 * (r["seed"] - 41)} if r["arm"] == "grpo + lbl" else r
             for r in results]  # fmt: skip
    rows = {r[0]: r for r in _section(scores_table(moved, "math_post", ("grpo", "grpo + lbl"), "grpo"), "math_post")}
    assert rows["grpo + lbl"][4].startswith("+7.5 [+5.0, +10.0]")


def test_a_grid_without_claims_reports_none(rl_finished, tmp_path):
    """A reinforcement-learning grid of one's own need not declare claims: its report says so and draws none."""
    import dataclasses

    study, results = rl_finished
    tables = report_rl(dataclasses.replace(study.grid, claims=None), [study], results, tmp_path)
    assert "(fixed before the first cell: none declared)" in tables
    section = tables.split("### The claims", 1)[1].split("### What the grid could detect", 1)[0]
    assert len([line for line in section.splitlines() if line.startswith("|")]) == 2  # the header alone
    assert (tmp_path / "claims.svg").is_file() and (tmp_path / "tables.md").read_text() == tables
