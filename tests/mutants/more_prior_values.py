"""Mutants of a prior's values and tensor hash, checked by every command that reads one
(issue 48); joined into ``tests.mutants.catalogue.MUTANTS``."""

from __future__ import annotations

from tests.mutants.harness import Mutant

MUTANTS: tuple[Mutant, ...] = ()
