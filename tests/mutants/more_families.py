"""Mutants of public replicas of real families and the family matrix
(issue 48); joined into ``tests.mutants.catalogue.MUTANTS``."""

from __future__ import annotations

from tests.mutants.harness import Mutant

MUTANTS: tuple[Mutant, ...] = ()
