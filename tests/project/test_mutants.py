"""``make mutants`` (tests/mutants): every mutant of the catalogue still applies to today's source -- exactly
one match inside its function -- and, under CI, the subset CI runs is killed (docs/testing.md)."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from tests.mutants.catalogue import MUTANTS
from tests.mutants.harness import ROOT, Mutant, MutationError, mutate, run_mutant, scratch_copy, warm_pytest


def test_the_catalogue_is_large_unique_and_every_mutant_applies():
    assert len(MUTANTS) >= 25 and len({m.name for m in MUTANTS}) == len(MUTANTS)
    for m in MUTANTS:
        source = (ROOT / "src" / "rpb" / m.path).read_text()
        assert mutate(source, m) != source, m.name
        assert m.story and m.tests and all(Path(ROOT, t.split("::")[0]).is_file() for t in m.tests), m.name
    assert any(m.ci for m in MUTANTS)


def test_a_mutation_that_no_longer_applies_is_a_harness_error():
    stale = Mutant("stale", "a pattern the source no longer has", "prior/math.py", "log_prior_bias",
                   r"no such code", "x", ("tests/prior/test_math.py",))  # fmt: skip
    with pytest.raises(MutationError, match="matches 0 times"):
        mutate((ROOT / "src" / "rpb" / "prior" / "math.py").read_text(), stale)
    twice = Mutant("twice", "a pattern matching twice", "prior/math.py", "log_prior_bias", r"log_q", "x", ("t",))
    with pytest.raises(MutationError, match="matches 3 times"):
        mutate((ROOT / "src" / "rpb" / "prior" / "math.py").read_text(), twice)


@pytest.mark.skipif(not os.environ.get("CI"), reason="CI runs its subset of the mutants (make mutants runs all)")
def test_the_ci_subset_of_mutants_is_killed():
    import shutil

    scratch = scratch_copy()
    runner = warm_pytest(scratch)
    # an equivalent mutant (the same bias, written another way) must survive in the same forked runs: a child
    # that did not import the mutated copy, or that read every run as failed, could not tell it from the others
    same = Mutant("equivalent", "the centring's mean written as a sum over E divided by E", "prior/math.py",
                  "log_prior_bias", r"log_q\.mean\(dim=-1, keepdim=True\)",
                  "log_q.sum(-1, keepdim=True) / log_q.shape[-1]",
                  ("tests/prior/test_math.py::test_clip_and_bias_golden",))  # fmt: skip
    try:
        outcomes = {m.name: run_mutant(scratch, m, 300, runner)[0] for m in MUTANTS if m.ci}
        equivalent = run_mutant(scratch, same, 300, runner)
    finally:
        runner.close()
        shutil.rmtree(scratch.parent, ignore_errors=True)
    assert outcomes and set(outcomes.values()) == {"killed"}, outcomes
    assert equivalent[0] == "survived", equivalent


def test_docs_testing_lists_every_mutant():
    doc = (ROOT / "docs" / "testing.md").read_text()
    missing = [m.name for m in MUTANTS if f"`{m.name}`" not in doc]
    assert missing == [] and f"{len(MUTANTS)} mutants" in doc
