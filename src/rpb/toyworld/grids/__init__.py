"""The toy world's grids, one module each: its arms, recipe, seeds, bases, and any claim, table, study or report of
its own, declared as data and small functions that the study machinery (``rpb.toyworld.study``) calls.

A grid module names its grid ``GRID``. ``rpb experiment --grid NAME`` runs the grid of that name among this
package's modules; ``--grid package.module:ATTR`` runs the grid ``ATTR`` of any importable module (a grid of one's
own, outside this package). Adding a grid is one module here and its shipped results.
"""

from __future__ import annotations

import importlib
import pkgutil

from rpb.errors import RpbError

#: the grid ``rpb experiment`` runs when none is named: minutes, not hours
DEFAULT = "small"


def grids() -> dict:
    """Every grid of this package by name, in module order."""
    found = {}
    for info in sorted(pkgutil.iter_modules(__path__), key=lambda m: m.name):
        grid = getattr(importlib.import_module(f"{__name__}.{info.name}"), "GRID", None)
        if grid is not None:
            found[grid.name] = grid
    return found


def find(spec: str):
    """The grid named ``spec`` in this package, or ``module:ATTR``'s grid; every other spec refused by name."""
    if ":" not in spec:
        known = grids()
        if spec not in known:
            raise RpbError(f"no grid {spec!r}: the grids are {', '.join(known)}, or give module:ATTR")
        return known[spec]
    module, _, attr = spec.partition(":")
    try:
        grid = getattr(importlib.import_module(module), attr)
    except ModuleNotFoundError as err:
        raise RpbError(f"--grid {spec}: cannot import {module!r} ({err})") from err
    except AttributeError as err:
        raise RpbError(f"--grid {spec}: module {module!r} has no {attr!r}") from err
    if not all(hasattr(grid, f) for f in ("name", "sets", "arms", "seeds", "bases")):
        raise RpbError(f"--grid {spec}: {type(grid).__name__} is not a grid (rpb.toyworld.study.grid.Grid)")
    return grid
