"""Mutants of issue 63's data mixing (``rpb.data.mix``); joined into ``tests.mutants.catalogue.MUTANTS``."""

from __future__ import annotations

from tests.mutants.harness import Mutant

MIX = "tests/data/test_mix.py"

MUTANTS: tuple[Mutant, ...] = (
    Mutant(
        name="mix_places_drawn_with_replacement",
        story="the places the mixed rows take are drawn with replacement: a mixed row lands on a place another "
        "already took, so a mixed row is lost and a training row the record says was replaced trains instead",
        path="data/mix.py",
        function="mix",
        pattern=r"places = _draw\(n, sum\(takes\), generator\)",
        replacement="places = torch.randint(n, (sum(takes),), generator=generator).tolist()",
        tests=(f"{MIX}::test_the_mixed_rows_take_the_places_drawn_and_every_row_appears_once",),
    ),
)
