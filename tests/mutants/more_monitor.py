"""Mutants of the routing monitor: its figures, logs, masks and transform
(issue 48); joined into ``tests.mutants.catalogue.MUTANTS``."""

from __future__ import annotations

from tests.mutants.harness import Mutant

MUTANTS: tuple[Mutant, ...] = ()
