"""One base of a grid paired with a shipped grid (``PairedStudy``): the cells of its arms with another prior kind
trained here, its probability cells taken from the shipped grid it names (its ``paired_grid``).

A probability cell of such a grid is the paired grid's cell of the same (set, arm, seed) on the same base: the same
arm, data, prior and recipe, so the same training. Where the repository ships that grid's base with the same
pinned base weights and recipe, the cell's result file is copied as it is (its bytes unchanged, so the pairing is
with exactly the cells the paired grid reports); where it does not (another base, or no repository beside the
package), the cell is trained here like any other.
"""

from __future__ import annotations

import json
import shutil
from dataclasses import dataclass
from pathlib import Path

from rpb.fileio import atomic_path
from rpb.toyworld.study.cells import Study
from rpb.toyworld.study.grid import Arm

#: the repository's shipped grids (docs/results/<grid>/base<seed>/), beside the shipped bases
SHIPPED_RESULTS = Path(__file__).resolve().parents[4] / "docs" / "results"


def shipped_base(study: Study, shipped_results: Path, grid: str) -> Path | None:
    """``grid``'s shipped folder of ``study``'s base, if it pins the same base weights and recipe as ``study``'s
    (its ``grid.json``, written before any cell)."""
    base = shipped_results / grid / study.out.name
    pinned = base / "grid.json"
    if not pinned.is_file():
        return None
    theirs, ours = json.loads(pinned.read_text()), json.loads((study.out / "grid.json").read_text())
    return base if all(theirs.get(k) == ours.get(k) for k in ("post_recipe", "base_sha256")) else None


def copy_cell(source: Path, done: Path) -> None:
    """A shipped result file copied as it is (its bytes unchanged) to ``done``, atomically; nothing where ``source``
    is missing or ``done`` already finished."""
    if source.is_file() and not done.is_file():
        with atomic_path(done) as tmp:
            shutil.copyfile(source, tmp)


@dataclass
class PairedStudy(Study):
    """A ``Study`` that takes its probability arms' cells from the shipped paired grid when it pins the same set-up
    (``shipped_results``: where the shipped grids are)."""

    shipped_results: Path = SHIPPED_RESULTS

    def paired_cell(self, post_set: str, arm: Arm, seed: int) -> Path | None:
        """The paired grid's result file for this cell, if it ships one on this base with the same pinned base
        weights and recipe."""
        base = shipped_base(self, self.shipped_results, self.grid.paired_grid)
        if arm.prior_kind != "probability" or base is None:
            return None
        cell = base / "runs" / post_set / arm.slug / f"seed{seed}" / "result.json"
        return cell if cell.is_file() else None

    def grid_cell(self, post_set: str, arm: Arm, seed: int) -> dict:
        done = self.out / "runs" / post_set / arm.slug / f"seed{seed}" / "result.json"
        source = None if done.is_file() else self.paired_cell(post_set, arm, seed)
        if source is not None:
            copy_cell(source, done)
        return super().grid_cell(post_set, arm, seed)
