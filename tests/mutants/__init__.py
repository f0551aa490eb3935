"""``make mutants``: realistic bugs written into a scratch copy of the source, each run against the tests that
must catch it (``catalogue.MUTANTS``; the harness: ``harness.py``; docs/testing.md)."""
