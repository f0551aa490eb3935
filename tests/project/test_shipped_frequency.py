"""The ``beta-frequency`` grid's shipped results (docs/results/beta-frequency): every base whole, pinning today's
grid on the shipped base; its probability cells the ``beta`` grid's own files, byte for byte; its frequency
cells trained with the frequency prior; the report what today's code makes of the shipped cells, figures byte
for byte; and docs/collect.md quoting each claim's verdict as the report computes it."""

from __future__ import annotations

import json
import shutil
import statistics
from pathlib import Path

from rpb.toyworld.grids.beta_frequency import GRID as FREQUENCY_GRID
from rpb.toyworld.prior_kinds import table
from rpb.toyworld.study.figures import CLAIMS, FOREST
from rpb.toyworld.study.grid import pinned_fields
from rpb.toyworld.study.shipping import report_shipped, shipped_results, shipped_studies
from tests.project.test_prose_figures import claim_rows, flat, unicode_minus

ROOT = Path(__file__).resolve().parents[2]
RESULTS = ROOT / "docs" / "results"
SHIPPED = RESULTS / FREQUENCY_GRID.name


def _base_folders() -> list[Path]:
    return sorted(p for p in SHIPPED.glob("base*") if p.is_dir())


def test_every_base_is_shipped_whole_and_pins_todays_grid():
    assert [p.name for p in _base_folders()] == [f"base{b}" for b in FREQUENCY_GRID.bases]
    assert not (SHIPPED / "unfinished").exists()
    shipped_bases = json.loads((ROOT / "bases" / "bases.json").read_text())
    for folder, b in zip(_base_folders(), FREQUENCY_GRID.bases, strict=True):
        pinned = json.loads((folder / "grid.json").read_text())
        assert pinned["grid"] == json.loads(json.dumps(pinned_fields(FREQUENCY_GRID)))
        assert pinned["base_sha256"] == shipped_bases[f"base{b}"]["weights_sha256"]
        beta = json.loads((RESULTS / "beta" / folder.name / "grid.json").read_text())
        assert (pinned["post_recipe"], pinned["base_sha256"]) == (beta["post_recipe"], beta["base_sha256"])
        cells = sorted((folder / "runs").glob("*/*/*/result.json"))
        assert len(cells) == len(FREQUENCY_GRID.sets) * len(FREQUENCY_GRID.arms) * len(FREQUENCY_GRID.seeds)
        for path in cells:
            cell = json.loads(path.read_text())
            arm = next(a for a in FREQUENCY_GRID.arms if a.slug == path.parent.parent.name)
            assert (cell["arm"], cell["base"], cell["anchor"]) == (arm.label, b, dict(arm.anchor))
            if arm.prior_kind == "frequency":
                assert cell["prior_kind"] == "frequency" and cell["method"] == "rpb"
            else:  # the beta grid's own cell, its bytes unchanged
                twin = RESULTS / "beta" / path.relative_to(SHIPPED)
                assert path.read_bytes() == twin.read_bytes()


def test_the_shipped_tables_are_the_report_of_the_shipped_cells(tmp_path):
    out = tmp_path / FREQUENCY_GRID.name
    shutil.copytree(SHIPPED, out)
    for f in (FOREST, CLAIMS):  # the report must make them, not find them
        (out / f).unlink()
    sts = shipped_studies(FREQUENCY_GRID, out)
    assert len([r for st in sts for r in shipped_results(st)]) == 72
    tables = report_shipped(FREQUENCY_GRID, out)
    assert tables == (SHIPPED / "tables.md").read_text()
    for f in ("results.json", "bases.json"):
        assert json.loads((out / f).read_text()) == json.loads((SHIPPED / f).read_text())
    for f in (FOREST, CLAIMS):
        assert (out / f).read_bytes() == (SHIPPED / f).read_bytes(), f


def test_the_results_page_shows_the_figure_and_collect_md_quotes_every_verdict():
    tables = (SHIPPED / "tables.md").read_text()
    assert f"]({FOREST})" in tables and (SHIPPED / FOREST).is_file()
    assert f"results/{FREQUENCY_GRID.name}/tables.md" in (ROOT / "mkdocs.yml").read_text()
    claims = claim_rows(tables)
    assert len(claims) == 8
    quoted = flat((ROOT / "docs" / "collect.md").read_text())
    for row in claims:
        said = f"{row['claim (frequency vs probability)']}: {row['verdict']} by rule, {row['Holm-adjusted']} after Holm"
        assert flat(said) in quoted, said


def test_collect_md_shows_the_shipped_comparison_and_its_figures():
    """docs/collect.md's frequency-vs-probability table is the shipped one, which is ``table`` of the shipped
    figures; every range and mean its prose quotes is computed from them here."""
    found = json.loads((SHIPPED / "prior_kinds.json").read_text())
    assert [(c["base"], c["set"]) for c in found] == [(b, s) for b in FREQUENCY_GRID.bases for s in FREQUENCY_GRID.sets]
    assert (SHIPPED / "prior_kinds.md").read_text() == table(found)
    text = (ROOT / "docs" / "collect.md").read_text()
    assert table(found) in text
    prose = flat(text)

    def values(key, *path):
        return [v for c in found for v in _dig(c[key], path)]

    def pct(v):
        return f"{100 * v:.0f}%"

    tvd = values("tvd")
    assert f"TVD {min(tvd):.3f} to {max(tvd):.3f} per layer" in prose
    p, f = values("clipped_share", "probability"), values("clipped_share", "frequency")
    assert (
        f"lifts {pct(min(f))} to {pct(max(f))} of its (row, expert) pairs against {pct(min(p))} to {pct(max(p))}"
        in prose
    )
    for beta in ("0.25", "1"):
        means = [
            f"{100 * statistics.fmean(values('displacement', k, beta)):.1f}%" for k in ("probability", "frequency")
        ]
        assert all(m in prose for m in means), (beta, means)
        differ = values("disagreement", beta)
        assert f"{pct(min(differ))} to {pct(max(differ))} of content tokens at beta {beta}" in prose or (
            f"{pct(min(differ))} to {pct(max(differ))} at beta {beta}" in prose
        ), beta


def _dig(value, path):
    for key in path:
        value = value[key]
    return value


def test_the_quoted_differences_are_the_reports():
    """The paired differences the README and docs/collect.md quote, read off the report's scores table."""
    rows = [line.split(" | ") for line in (SHIPPED / "tables.md").read_text().splitlines() if line.startswith("| ")]
    scores = [r for r in rows if len(r) == 8]  # the scores table: beta, set, then ID and OOD triples
    delta = {(r[0].strip("| "), r[1], m): unicode_minus(r[4 if m == "id" else 7].strip(" |"))
             for r in scores for m in ("id", "ood")}  # fmt: skip
    readme, collect_md = flat((ROOT / "README.md").read_text()), flat((ROOT / "docs" / "collect.md").read_text())
    assert f"At beta 1 the frequency prior costs {delta[('1', 'both', 'id')]} points in domain" in readme
    for key in (("0.25", "both", "id"), ("0.25", "both", "ood"), ("1", "both", "id"), ("1", "both", "ood"),
                ("1", "math_post", "id"), ("1", "code_post", "id")):  # fmt: skip
        assert delta[key] in collect_md, key
