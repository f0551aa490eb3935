"""The frequency grid's probability cells: the shipped beta grid's own files where it pins the same set-up, else
none (trained here)."""

from __future__ import annotations

import json

from rpb.toyworld.grids.beta_frequency import GRID as FREQUENCY_GRID
from rpb.toyworld.study.grid import SEEDS, STUDY_POST
from rpb.toyworld.study.paired import SHIPPED_RESULTS, PairedStudy


def _pin(folder, base_sha256="b" * 64, recipe="r"):
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "grid.json").write_text(
        json.dumps({"grid": {"name": "x"}, "post_recipe": recipe, "base_sha256": base_sha256})
    )


def test_probability_cells_are_the_shipped_beta_grids_files(tmp_path):
    shipped = tmp_path / "shipped"
    probability, frequency = FREQUENCY_GRID.arms[0], FREQUENCY_GRID.arms[2]
    cell = shipped / "beta" / "base0" / "runs" / "math_post" / probability.slug / "seed42" / "result.json"
    cell.parent.mkdir(parents=True)
    record = {"set": "math_post", "arm": probability.label, "seed": 42, "id": 0.5, "ood": 0.25, "from": "beta"}
    cell.write_text(json.dumps(record, indent=1))
    _pin(shipped / "beta" / "base0")
    st = PairedStudy(tmp_path / "run" / "base0", FREQUENCY_GRID, STUDY_POST, shipped_results=shipped)
    _pin(st.out)
    assert st.paired_cell("math_post", probability, 42) == cell
    assert st.paired_cell("math_post", frequency, 42) is None  # trained here, never borrowed
    assert st.paired_cell("math_post", probability, 43) is None  # not shipped: trained here
    assert st.grid_cell("math_post", probability, 42) == record
    copied = st.out / "runs" / "math_post" / probability.slug / "seed42" / "result.json"
    assert copied.read_bytes() == cell.read_bytes()  # its bytes as shipped
    for changed in ({"base_sha256": "c" * 64}, {"recipe": "other"}):  # another base's weights, another recipe
        _pin(st.out, **changed)
        assert st.paired_cell("math_post", probability, 42) is None


def test_the_repositorys_beta_grid_pins_what_the_frequency_grid_pins():
    """The shipped beta cells the grid borrows: every (set, beta, seed) of each base is there."""
    for base in FREQUENCY_GRID.bases:
        pinned = json.loads((SHIPPED_RESULTS / "beta" / f"base{base}" / "grid.json").read_text())
        assert pinned["post_recipe"]["max_seq_len"] == STUDY_POST.max_seq_len
        for arm in FREQUENCY_GRID.arms[:2]:
            for post_set in FREQUENCY_GRID.sets:
                for seed in SEEDS:
                    path = SHIPPED_RESULTS / "beta" / f"base{base}" / "runs" / post_set / arm.slug / f"seed{seed}"
                    assert json.loads((path / "result.json").read_text())["arm"] == arm.label
