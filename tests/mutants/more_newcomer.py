"""Mutants of the rows a new user's data file holds: empty messages, dry runs, truncation
(issue 48); joined into ``tests.mutants.catalogue.MUTANTS``."""

from __future__ import annotations

from tests.mutants.harness import Mutant

MUTANTS: tuple[Mutant, ...] = ()
