"""The ``hold-stored`` grid in prose: docs/methods.md's finding quotes the shipped report
(docs/results/hold-stored/tables.md, itself regenerated from the shipped cells by
tests/project/test_shipped_hold_stored.py): every claim's estimate, interval and verdicts, and the bytes per token
each stored form needs, so a new base or a rerun makes this fail until the prose follows it."""

from __future__ import annotations

import re

from tests.project.test_prose_figures import DOCS, flat, sections, shipped_so_far, table_rows
from tests.project.test_prose_hold import bullets, claim_phrases

SHIPPED = DOCS / "results" / "hold-stored"
HEADING = "**What the toy world's `hold-stored` grid found**"


def finding() -> str:
    """docs/methods.md's paragraph on the grid, from its heading to the next bold heading, as written (bullets on
    their own lines)."""
    text = (DOCS / "methods.md").read_text()
    assert HEADING in text
    return text.split(HEADING, 1)[1].split("\n**", 1)[0]


def moonlight_bytes(report: dict[str, str]) -> set[str]:
    """Each stored form's route-file bytes per token at Moonlight's shape, from the report's storage table."""
    title = next(t for t in report if t.startswith("What each stored form costs"))
    return {r["bytes/token Moonlight"] for r in table_rows(report[title]) if r["bytes/token Moonlight"] != "n/a"}


def test_methods_md_quotes_the_hold_stored_report():
    """Linked; each claim's bullet carries its estimate, interval and verdicts on both sets; each stored form's
    bytes per token are the report's; while bases are missing it says which are shipped, and once whole the
    old advice (routes unproven) is gone."""
    report = sections((SHIPPED / "tables.md").read_text(), "###")
    written = finding()
    said, by_claim = flat(written), bullets(written)
    assert "](results/hold-stored/tables.md)" in said
    for number, phrase in claim_phrases(report):
        assert phrase in by_claim.get(number, ""), (number, phrase)
    for size in moonlight_bytes(report):
        assert re.search(rf"\b{size} bytes\b", said), size
    bases = sorted(int(p.name.removeprefix("base")) for p in SHIPPED.glob("base*") if p.is_dir())
    under_way = shipped_so_far(bases)
    assert (f"({under_way} shipped" in said) == bool(under_way)
    assert bool(under_way) or "unproven" not in flat((DOCS / "methods.md").read_text())


def test_the_phrases_follow_the_report():
    """An edited figure in the report's claims changes what is asked of the prose."""
    report = sections((SHIPPED / "tables.md").read_text(), "###")
    title = next(t for t in report if t.startswith("The claims, fixed"))
    (row,) = [ln for ln in report[title].splitlines() if ln.startswith("| (3)") and "(code_post" in ln]
    cells = row.split(" | ")
    cells[1:3], cells[4:6] = ["+99.9", "[+98.0, +99.9]"], ["inconclusive", "inconclusive"]
    changed = dict(report) | {title: report[title].replace(row, " | ".join(cells))}
    assert ("(3)", "+99.9 [+98.0, +99.9] on code (inconclusive; after Holm inconclusive)") in claim_phrases(changed)
    assert claim_phrases(changed) != claim_phrases(report)
