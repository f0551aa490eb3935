"""The ``rl-stale`` grid's shipped results (docs/results/rl-stale): every base whole, pinning today's grid on the
shipped base; each cell started from its base's recorded start, trained as the ``rl`` grid's start is (bit for bit
on the same machine type, threads and torch build); every cell records the stale figure at each later update; the
report is what today's code makes of the shipped cells, figures byte for byte; and docs/rl.md quotes each claim's
verdict as the report computes it."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from rpb.toyworld.grids.rl_stale import GRID, PILOT, ROUTING_KD_WEIGHTS
from rpb.toyworld.study.figures import CLAIMS
from rpb.toyworld.study.grid import pinned_fields
from rpb.toyworld.study.rl_figures import RL_FIGURE
from rpb.toyworld.study.shipping import report_shipped, shipped_results, shipped_studies
from tests.project.test_prose_figures import claim_rows, flat

ROOT = Path(__file__).resolve().parents[2]
RESULTS = ROOT / "docs" / "results"
SHIPPED = RESULTS / "rl-stale"


def _base_folders() -> list[Path]:
    return sorted(p for p in SHIPPED.glob("base*") if p.is_dir())


def test_every_base_is_shipped_whole_and_pins_todays_grid():
    folders = _base_folders()
    assert [p.name for p in folders] == [f"base{b}" for b in GRID.bases]
    assert not (SHIPPED / "unfinished").exists()
    pilot = json.loads((SHIPPED / "pilot.json").read_text())
    assert (tuple(pilot["pressure"]), pilot["pr2_lr_scale"]) == (PILOT["pressure"], PILOT["pr2_lr_scale"])
    shipped_bases = json.loads((ROOT / "bases" / "bases.json").read_text())
    updates = PILOT["pressure"][0] * PILOT["pressure"][1]
    for folder, b in zip(folders, GRID.bases, strict=True):
        pinned = json.loads((folder / "grid.json").read_text())
        assert pinned["grid"] == json.loads(json.dumps(pinned_fields(GRID)))
        assert pinned["base_sha256"] == shipped_bases[f"base{b}"]["weights_sha256"]
        start = json.loads((folder / "start" / "record.json").read_text())
        cells = [json.loads(p.read_text()) for p in (folder / "runs").glob("*/*/*/result.json")]
        assert len(cells) == len(GRID.arms) * len(GRID.seeds)
        for cell in cells:
            assert (cell["base"], cell["start_sha256"]) == (b, start["weights_sha256"])
            assert len(cell["rl"]["reward"]) == GRID.recipe.max_steps
            by_update = cell["rl"]["stale_mismatch_by_update"]
            assert sorted(int(i) for i in by_update) == list(range(1, updates)), cell["arm"]
        selection = [json.loads(p.read_text()) for p in (folder / "selection").glob("*/result.json")]
        assert sorted(w for s in selection for w in s["anchor"].values()) == sorted(ROUTING_KD_WEIGHTS)
        assert all(s["part"] == "validation" and s["seed"] == GRID.seeds[0] for s in selection)


@pytest.mark.parametrize("b", GRID.bases)
def test_each_start_is_trained_as_the_rl_grids_start(b):
    """The ``rl`` grid's start recipe and seed; on the same machine type, threads and torch build its very weights
    (another CPU rounds differently: the rl grid's starts ran on AMD EPYC, these may not)."""
    here = json.loads((SHIPPED / f"base{b}" / "start" / "record.json").read_text())
    rl = json.loads((RESULTS / "rl" / f"base{b}" / "start" / "record.json").read_text())
    assert (here["set"], here["method"], here["seed"]) == (rl["set"], rl["method"], rl["seed"])
    if (here["machine"], here["threads"], here.get("torch")) == (rl["machine"], rl["threads"], rl.get("torch")):
        assert (here["weights_sha256"], here["scores"]) == (rl["weights_sha256"], rl["scores"])


def test_the_shipped_tables_are_the_report_of_the_shipped_cells(tmp_path):
    out = tmp_path / "rl-stale"
    shutil.copytree(SHIPPED, out)
    figures = (RL_FIGURE, CLAIMS, "stale.svg")
    for f in figures:  # the report must make them, not find them
        (out / f).unlink()
    sts = shipped_studies(GRID, out)
    results = [r for st in sts for r in shipped_results(st)]
    assert len(results) == len(GRID.bases) * len(GRID.arms) * len(GRID.seeds)
    assert report_shipped(GRID, out) == (SHIPPED / "tables.md").read_text()
    for f in ("results.json", "bases.json"):
        assert json.loads((out / f).read_text()) == json.loads((SHIPPED / f).read_text())
    for f in figures:
        assert (out / f).read_bytes() == (SHIPPED / f).read_bytes(), f


def test_the_results_page_shows_the_figures_and_rl_md_quotes_every_verdict():
    """The grid's results page (tables.md, in the docs' navigation) shows its two figures; docs/rl.md states each
    claim's verdict by rule and after Holm's adjustment, as the report computes them."""
    tables = (SHIPPED / "tables.md").read_text()
    for f in (RL_FIGURE, "stale.svg"):
        assert f"]({f})" in tables and (SHIPPED / f).is_file(), f
    assert "results/rl-stale/tables.md" in (ROOT / "mkdocs.yml").read_text()
    claims = claim_rows(tables)
    assert len(claims) == 6
    quoted = flat((ROOT / "docs" / "rl.md").read_text())
    for row in claims:
        number = row["claim (fixed before the grid ran, with its margin)"].split(")")[0] + ")"
        holm = row["Holm-adjusted"]  # claim (2) is reported outside the family, so it has no adjusted verdict
        after = holm if holm == "outside Holm" else f"{holm} after Holm"
        said = f"claim {number}: {row['verdict']} by rule, {after}"
        assert flat(said) in quoted, said


def test_the_followup_is_the_report_of_its_runs_and_rl_md_quotes_it(tmp_path):
    """The follow-up pilot (PR2 below scale 50, against R2 on its own runs): its table regenerated from the shipped
    runs byte for byte, and docs/rl.md quoting its conclusion and each scale's PR2 − R2."""
    from rpb.toyworld.grids.rl_stale_followup import SCALES, write_report

    shipped = ROOT / "docs" / "results" / "rl-stale" / "followup"
    for scale in SCALES:
        shutil.copy(shipped / f"pr2-{scale:g}.json", tmp_path)
    text = write_report(tmp_path)
    assert text == (shipped / "followup.md").read_text()
    rl = " ".join((ROOT / "docs" / "rl.md").read_text().split())
    for row in (ln for ln in text.splitlines() if ln.startswith("| ") and ln[2].isdigit()):
        scale, *_, against_r2 = (c.strip() for c in row.strip("|").split("|"))
        assert f"{against_r2} at {scale}" in rl, (scale, against_r2)
    assert "staler than R2's would have been at every scale tried" in text and "at every scale tried" in rl
