"""Shipping a grid's finished cells into the repository, base by base (``docs/results/<grid>/base<seed>/``).

A grid takes hours and a run folder does not outlive its machine, so each base's cells are committed as
soon as all of them are finished, with everything the report reads back: the pinned set-up (grid.json),
the weight selection, the base's facts and scores, its calibration. Nothing that can be remade from the
recipe travels (data, priors, the probe set) and nothing large (checkpoints, retention folders).

A base still running keeps its finished runs in ``unfinished/base<seed>/`` (with its ``grid.json``), which
the report never reads: ``rpb experiment --resume-from docs/results/<grid>`` puts every shipped run back in
a fresh run folder, so a grid goes on across machines without rerunning a finished cell.

Beside the base folders, ``tables.md``, ``results.json``, ``bases.json``, ``forest.svg`` and ``claims.svg`` are
the report over the bases shipped so far (its title names them); tests/project/test_shipped_results.py makes
it again from the shipped files alone, so a figure in them is always the code's own.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import shutil
from pathlib import Path

from rpb.errors import RpbError
from rpb.fileio import atomic_path
from rpb.toyworld.study.across import report_across, studies, study_kind
from rpb.toyworld.study.cells import GridChangedError, Study, _quiet_loading, cell_paths
from rpb.toyworld.study.grid import Grid
from rpb.toyworld.world.post import PostRecipe

#: what a base's report reads back, as glob patterns under its run folder (and the study's own ``Study.ships``)
SHIPPED_FILES = (
    "grid.json",
    "selection.json",
    "base_facts.json",
    "base_scores/*.json",
    "calibration/*/calibrate.json",
    "calibration/*/calibrate.md",
    "selection/*/result.json",
    "runs/*/*/*/result.json",
)


#: where a base with unfinished runs keeps its finished ones, under the grid's shipping folder
UNFINISHED = "unfinished"


class NotFinishedError(RpbError):
    """A base whose cells are not all finished cannot be shipped."""


def _needs_calibration(grid: Grid) -> bool:
    # a report that judges the beta rule needs the calibration though no arm of the grid is calibrated
    return grid.judges_beta_rule or any(a.calibrated for a in grid.arms)


def _refuse_another_set_up(st: Study, target: Path) -> None:
    pinned = target / "grid.json"
    if pinned.is_file() and json.loads(pinned.read_text()) != json.loads((st.out / "grid.json").read_text()):
        raise GridChangedError(f"{pinned}: the shipped base pins another set-up than {st.out / 'grid.json'}")


def ship_base(st: Study, dest: Path) -> list[Path]:
    """Copy a finished base's files to ``dest/<its folder name>/``; returns the shipped paths.

    Refused while any of its cells is unfinished (all are named), and when the destination pins another
    set-up. The base's facts and calibration are made first if the run has not made them yet (a grid that
    judges the beta rule makes it at report time), which needs the base model."""
    if not (st.out / "grid.json").is_file():
        raise NotFinishedError(f"{st.out}: not started")
    missing = [p for p in cell_paths(st) if not p.is_file()]
    if missing:
        names = ", ".join(str(p.parent.relative_to(st.out)) for p in missing)
        raise NotFinishedError(f"{st.out}: {len(missing)} of {len(cell_paths(st))} runs not finished: {names}")
    st.base_facts()
    if _needs_calibration(st.grid):
        for s in st.grid.sets:
            st.calibration(s)
    target = Path(dest) / st.out.name
    _refuse_another_set_up(st, target)
    shipped = []
    for pattern in (*SHIPPED_FILES, *st.ships):
        for source in sorted(st.out.glob(pattern)):
            path = target / source.relative_to(st.out)
            with atomic_path(path) as tmp:
                shutil.copyfile(source, tmp)
            shipped.append(path)
    return shipped


def keep_unfinished(st: Study, dest: Path) -> list[Path]:
    """Copy a started base's finished runs and its ``grid.json`` to ``dest/unfinished/<its folder name>/``
    (added to what an earlier call kept there), with the finished files its study kind ships besides (``ships``:
    the hold grid's retrained revert cells); returns the paths of the runs kept there in all."""
    target = Path(dest) / UNFINISHED / st.out.name
    _refuse_another_set_up(st, target)
    own = [p for pattern in st.ships for p in sorted(st.out.glob(pattern)) if p.is_file()]
    for source in [st.out / "grid.json", *(p for p in cell_paths(st) if p.is_file()), *own]:
        with atomic_path(target / source.relative_to(st.out)) as tmp:
            shutil.copyfile(source, tmp)
    return [p for p in cell_paths(dataclasses.replace(st, out=target)) if p.is_file()]


def _several_bases(grid: Grid, out: Path) -> None:
    if len(grid.bases) < 2:
        raise RpbError(f"grid {grid.name!r} runs on one base: its results are its output folder {out}")


def resume_from(grid: Grid, out: Path, dest: Path) -> str:
    """Put the runs shipped in ``dest`` (whole bases and ``unfinished/``) back into the run folder ``out``, so
    that ``rpb experiment`` reads them back instead of running them again; returns what was put, base by base.

    Every file of a shipped base is copied (its scores, calibration and facts too), none over a file the run
    folder holds already. A run folder that pins another set-up than a shipped base is refused before anything
    is copied; a shipped base of another set-up than today's grid is then refused by the run's own pin."""
    _several_bases(grid, out)
    pairs = []
    for st in studies(grid, out, progress=False):
        for source in (Path(dest) / st.out.name, Path(dest) / UNFINISHED / st.out.name):
            if (source / "grid.json").is_file():
                _refuse_another_set_up(dataclasses.replace(st, out=source), st.out)
                pairs.append((st, source))
    lines = []
    for st, source in pairs:
        copied = [p for p in sorted(source.rglob("*")) if p.is_file() and not (st.out / p.relative_to(source)).exists()]
        for path in copied:
            with atomic_path(st.out / path.relative_to(source)) as tmp:
                shutil.copyfile(path, tmp)
        runs = sum(p.name == "result.json" for p in copied)
        lines.append(f"base {st.base_seed}: {runs} finished runs from {source} ({len(copied)} files)")
    return "\n".join(lines) or f"{dest}: no run of grid {grid.name!r} shipped there"


def shipped_studies(grid: Grid, dest: Path) -> list[Study]:
    """A Study over each base folder shipped in ``dest``, in the grid's order (nothing is built)."""
    post, kind = grid.post or PostRecipe(), study_kind(grid)
    return [
        kind(Path(dest) / f"base{b}", grid, post, progress=False, base_seed=b)
        for b in grid.bases
        if (Path(dest) / f"base{b}" / "grid.json").is_file()
    ]


def shipped_results(st: Study) -> list[dict]:
    """A shipped base's cells, in the grid's order (its selection runs aside)."""
    g = st.grid
    return [json.loads(p.read_text()) for p in cell_paths(st)[: len(g.sets) * len(g.arms) * len(g.seeds)]]


def report_shipped(grid: Grid, dest: Path) -> str:
    """tables.md, results.json, bases.json and the figures in ``dest`` over the bases shipped there; returns the
    tables."""
    sts = shipped_studies(grid, dest)
    if not sts:
        raise NotFinishedError(f"{dest}: no base of grid {grid.name!r} shipped")
    part = dataclasses.replace(grid, bases=tuple(st.base_seed for st in sts))
    return report_across(part, sts, [r for st in sts for r in shipped_results(st)], Path(dest))


def ship(grid: Grid, out: Path, dest: Path, cache_dir=None) -> str:
    """Ship every base of the grid in ``out`` whose runs are all finished, then the report over the shipped
    bases; returns what was done, base by base."""
    _several_bases(grid, out)
    lines = []
    for st in studies(grid, out, cache_dir, progress=False):
        whole, kept = Path(dest) / st.out.name, Path(dest) / UNFINISHED / st.out.name
        if not (st.out / "grid.json").is_file() and (whole / "grid.json").is_file():
            lines.append(f"base {st.base_seed}: shipped already in {whole}, not run in {out}")
            continue
        try:
            with _quiet_loading():  # the calibration's model loads
                lines.append(f"base {st.base_seed}: {len(ship_base(st, dest))} files to {whole}")
            shutil.rmtree(kept, ignore_errors=True)  # whole now: its unfinished runs are in the base's folder
        except NotFinishedError as err:
            lines.append(f"base {st.base_seed}: not shipped ({err})")
            if (st.out / "grid.json").is_file() and any(p.is_file() for p in cell_paths(st)):
                lines.append(
                    f"base {st.base_seed}: {len(keep_unfinished(st, dest))} finished runs kept in {kept} "
                    "(not in the report; rpb experiment --resume-from takes them back)"
                )
    with contextlib.suppress(OSError):  # no base left unfinished
        (Path(dest) / UNFINISHED).rmdir()
    if not shipped_studies(grid, dest):
        lines.append(f"no whole base in {dest} yet: no report written")
        return "\n".join(lines)
    report_shipped(grid, dest)
    lines.append(f"wrote {Path(dest) / 'tables.md'}, results.json, bases.json and the figures over the shipped bases")
    return "\n".join(lines)
