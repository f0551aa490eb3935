"""The ``revert`` grid's shipped results (docs/results/revert): every base whole and pinning today's grid; each
retrained cell within ±2 points of the shipped ``full`` / ``rl`` cell it repeats (bit for bit where the same
machine type ran both), its RL cells started from the ``rl`` grid's start; the revert's exact match of the post
model the scoring's own; the report what today's code makes of the shipped cells, figures byte for byte; the
README and docs/retention.md quoting its verdicts as the report computes them."""

from __future__ import annotations

import json
import shutil
from dataclasses import asdict
from pathlib import Path

from rpb.toyworld.figures import CLAIMS
from rpb.toyworld.revert import REVERT_GRID
from rpb.toyworld.revert_report import REVERT_FIGURE, shipped_cell
from rpb.toyworld.shipping import report_shipped, shipped_results, shipped_studies
from tests.project.test_prose_figures import flat, sections, table_rows

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
        assert pinned["grid"] == json.loads(json.dumps(asdict(REVERT_GRID)))
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
    body = sections(tables, "###")
    claims = table_rows(body[next(t for t in body if t.startswith("The claims"))])
    assert len(claims) == 2
    quoted = flat((ROOT / "docs" / "retention.md").read_text())
    for row in claims:
        said = (
            f"{row['claim (fixed before the grid ran)']}: {row['verdict']} by rule, {row['Holm-adjusted']} after Holm"
        )
        assert flat(said) in quoted, said
