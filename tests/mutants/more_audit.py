"""Mutants of the audit: what it infers was asked, and what it leaves as found
(issue 48); joined into ``tests.mutants.catalogue.MUTANTS``."""

from __future__ import annotations

from tests.mutants.harness import Mutant

MUTANTS: tuple[Mutant, ...] = ()
