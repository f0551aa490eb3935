"""The ``revert`` grid's shipped results (docs/results/revert): every base whole and pinning today's grid; each
retrained cell within ±2 points of the shipped ``full`` / ``rl`` cell it repeats (bit for bit where the same
machine type ran both), its RL cells started from the ``rl`` grid's start; the revert's exact match of the post
model the scoring's own; the report what today's code makes of the shipped cells, figures byte for byte; the
README and docs/retention.md quoting its verdicts as the report computes them."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

from rpb.toyworld.grids.revert import GRID as REVERT_GRID
from rpb.toyworld.grids.revert import REVERT_FIGURE, shipped_cell
from rpb.toyworld.study.figures import CLAIMS
from rpb.toyworld.study.grid import pinned_fields
from rpb.toyworld.study.shipping import report_shipped, shipped_results, shipped_studies
from tests.project.test_prose_figures import claim_rows, flat, sections, table_rows

ROOT = Path(__file__).resolve().parents[2]
RESULTS = ROOT / "docs" / "results"
SHIPPED = RESULTS / REVERT_GRID.name
CELLS = len(REVERT_GRID.arms) * len(REVERT_GRID.seeds)


def _bases() -> list[Path]:
    return sorted(p for p in SHIPPED.glob("base*") if p.is_dir())


def _cells() -> list[dict]:
    return [json.loads(p.read_text()) for folder in _bases() for p in sorted(folder.glob("runs/*/*/*/result.json"))]


def test_every_base_is_shipped_whole_and_pins_todays_grid():
    assert [p.name for p in _bases()] == [f"base{b}" for b in REVERT_GRID.bases]
    assert not (SHIPPED / "unfinished").exists()
    shipped_bases = json.loads((ROOT / "bases" / "bases.json").read_text())
    for folder, b in zip(_bases(), REVERT_GRID.bases, strict=True):
        pinned = json.loads((folder / "grid.json").read_text())
        assert pinned["grid"] == json.loads(json.dumps(pinned_fields(REVERT_GRID)))
        assert pinned["base_sha256"] == shipped_bases[f"base{b}"]["weights_sha256"]
        assert len(list(folder.glob("runs/*/*/*/result.json"))) == CELLS


def test_the_retrained_cells_repeat_the_shipped_cells_within_two_points():
    for cell in _cells():
        theirs = shipped_cell(cell)
        for part in ("validation", "test"):
            for metric in ("id", "ood"):
                gap = abs(cell["scores"][part][metric] - theirs["scores"][part][metric])
                assert gap <= 0.02, (cell["arm"], cell["base"], cell["seed"], part, metric, gap)
        if theirs.get("machine") == cell["machine"] and theirs.get("threads") == cell["threads"]:
            assert cell["scores"] == theirs["scores"], (cell["arm"], cell["base"], cell["seed"])
        if "start_sha256" in cell:
            assert cell["start_sha256"] == theirs["start_sha256"] or theirs["machine"] != cell["machine"]


def test_the_reverts_figures_are_the_cells_own():
    for cell in _cells():
        for reference, sets in cell["revert"].items():
            assert list(sets) == list(REVERT_GRID.domains)
            for d, e in sets.items():
                v = e["variants"]
                if reference == "base":  # the revert decoded what the scoring decoded
                    assert v["post"]["exact_match"] == cell["scores"]["test"]["per_domain"][d]
                assert v["base"]["topk_overlap"] == 1.0
                assert abs(e["delta_nll"] - (v["post+base routers"]["nll"] - v["post"]["nll"])) < 1e-9
        assert set(cell["revert"]) == ({"base", "start"} if "start_sha256" in cell else {"base"})


def test_the_shipped_tables_are_the_report_of_the_shipped_cells(tmp_path):
    out = tmp_path / REVERT_GRID.name
    shutil.copytree(SHIPPED, out)
    for f in (REVERT_FIGURE, CLAIMS):  # the report must make them, not find them
        (out / f).unlink()
    sts = shipped_studies(REVERT_GRID, out)
    assert len([r for st in sts for r in shipped_results(st)]) == CELLS * len(REVERT_GRID.bases)
    tables = report_shipped(REVERT_GRID, out)
    assert tables == (SHIPPED / "tables.md").read_text()
    for f in ("results.json", "bases.json"):
        assert json.loads((out / f).read_text()) == json.loads((SHIPPED / f).read_text())
    for f in (REVERT_FIGURE, CLAIMS):
        assert (out / f).read_bytes() == (SHIPPED / f).read_bytes(), f


def test_retention_md_quotes_every_verdict_and_the_site_shows_the_report():
    tables = (SHIPPED / "tables.md").read_text()
    assert f"]({REVERT_FIGURE})" in tables
    assert f"results/{REVERT_GRID.name}/tables.md" in (ROOT / "mkdocs.yml").read_text()
    claims = claim_rows(tables)
    assert len(claims) == 2
    quoted = flat((ROOT / "docs" / "retention.md").read_text())
    for row in claims:
        said = (
            f"{row['claim (fixed before the grid ran)']}: {row['verdict']} by rule, {row['Holm-adjusted']} after Holm"
        )
        assert flat(said) in quoted, said


def _rows(tables: str, title: str) -> dict[tuple[str, str], dict[str, str]]:
    body = sections(tables, "###")
    return {(r["arm"], r["domain"]): r for r in table_rows(body[next(t for t in body if t.startswith(title))])}


def test_the_prose_figures_are_the_reports():
    """Every figure docs/retention.md and the README quote about the grid, read from its report."""
    tables = (SHIPPED / "tables.md").read_text()
    page, readme = flat((ROOT / "docs" / "retention.md").read_text()), flat((ROOT / "README.md").read_text())
    base = _rows(tables, "Reverted to the base's routers")
    start = _rows(tables, "Reverted to the start's routers")
    sft = base[("sft", "math_post (trained)")]
    quoted = [sft["ΔNLL"], base[("rpb", "math_post (trained)")]["ΔNLL"], base[("grpo", "math_post (trained)")]["ΔNLL"],
              base[("sft", "text")]["ΔNLL"], sft["overlap to the base"], sft["exact match"]]  # fmt: skip
    page = page.replace("−", "-")  # the page writes minus signs, the report hyphens
    for figure in quoted:
        assert figure in page, figure
    assert sft["ΔNLL"] in readme
    before, after = (float(x) for x in sft["overlap to the base"].split(" → "))
    assert f"{after - before:.2f}" == "0.03" and "brings back 0.03 of the top-k overlap" in readme
    assert "brings 0.03 of it back" in page
    claims = {r["claim (fixed before the grid ran)"]: r for r in claim_rows(tables)}
    untargeted = next(r for c, r in claims.items() if "untargeted" in c)
    assert f"{untargeted['estimate']} {untargeted['95% CI']}" in page
    biggest = max(abs(float(r["ΔNLL"].split()[0])) for r in start.values())
    assert biggest < 0.01 and "no domain by more than 0.01 nats" in page
    post = [float(r["overlap to the start"].split(" → ")[0]) for r in start.values()]
    assert f"{sum(post) / len(post):.2f}" == "0.93" and "overlap to the start 0.93" in page
    plain = sections(tables.replace("\\|", ""), "###")  # a column's title escapes its bars: |Δ|
    scores = table_rows(plain[next(t for t in plain if t.startswith("Exact match"))])
    same = sum(int(r["cells bit-identical in score"].split(" of ")[0]) for r in scores)
    gaps = [float(x) for r in scores for x in r["largest Δ to the shipped cell, ID / OOD"].split(" / ")]
    assert f"{same} of {len(_cells())} bit-identical in score" in page and f"within {max(gaps):.1f} points" in page
