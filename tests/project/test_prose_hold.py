"""The ``hold`` grid in prose: docs/study.md's section and docs/methods.md's finding quote the shipped report
(docs/results/hold/tables.md, itself regenerated from the shipped cells by tests/project/test_shipped_hold.py), so
a rerun of the grid makes these fail until the prose follows it."""

from __future__ import annotations

import re
from collections import Counter

from tests.project.test_prose_figures import DOCS, flat, grid_section, table_rows, unicode_minus

TITLE = "The hold grid: holding the routing"
SETS = {"math_post": "math", "code_post": "code"}


def claims(report: dict[str, str]) -> list[dict[str, str]]:
    return table_rows(report[next(t for t in report if t.startswith("The claims, fixed"))])


def quoted(row: dict[str, str]) -> str:
    """A claim's estimate and interval as the prose writes them: '+0.304 [+0.269, +0.343]', minus signs as −."""
    return unicode_minus(f"{row['estimate']} {row['95% CI']}")


def claim_phrases(report: dict[str, str]) -> list[tuple[str, str]]:
    """(claim number, what the prose's bullet on it must say) for each row of the claims table: the estimate and
    interval on that set with its verdict by rule and after Holm (or outside Holm, for (6)), e.g.
    ('(2)', '+18.9 [+13.6, +24.6] on math (reproduces; after Holm reproduces)')."""
    phrases = []
    for row in claims(report):
        number = row["claim (the grid's)"].split(")")[0] + ")"
        post_set = next(s for s in SETS if f"({s}" in row["claim (the grid's)"])
        after = "outside Holm" if row["Holm-adjusted"] == "outside Holm" else f"after Holm {row['Holm-adjusted']}"
        phrases.append((number, f"{quoted(row)} on {SETS[post_set]} ({row['verdict']}; {after})"))
    return phrases


def bullets(body: str) -> dict[str, str]:
    """The section's bullets keyed by the claim number each starts with ('- (2) ...' -> '(2)')."""
    return {b.split(" ", 1)[0]: flat(b) for b in re.split(r"^- ", body, flags=re.M)[1:] if b.startswith("(")}


def count_phrase(report: dict[str, str]) -> str:
    family = [r for r in claims(report) if r["Holm-adjusted"] != "outside Holm"]
    plain, holm = Counter(r["verdict"] for r in family), Counter(r["Holm-adjusted"] for r in family)
    return (
        f"Of the {len(family)} claims in the Holm family, {holm['reproduces']} reproduce, {holm['contradicted']} "
        f"are contradicted and {holm['inconclusive']} inconclusive after Holm's adjustment (by rule: "
        f"{plain['reproduces']}, {plain['contradicted']} and {plain['inconclusive']})"
    )


def test_the_hold_grids_section_quotes_its_shipped_report():
    """Linked, not copied; its heading and cell count follow the shipped bases; once whole, every claim's
    estimate, interval and verdicts and the count of verdicts are the report's."""
    _, _, body, report = grid_section("hold", TITLE)
    assert not any(r["Holm-adjusted"] == "not run" for r in claims(report))
    assert flat(count_phrase(report)) in flat(body)
    said = bullets(body)
    for number, phrase in claim_phrases(report):
        assert phrase in said.get(number, ""), (number, phrase)


def test_the_hold_phrases_follow_the_report():
    """An edited verdict or figure in the report changes what is asked of the prose."""
    _, _, _, report = grid_section("hold", TITLE)
    title = next(t for t in report if t.startswith("The claims, fixed"))
    (row,) = [ln for ln in report[title].splitlines() if ln.startswith("| (2)") and "(math_post" in ln]
    cells = row.split(" | ")
    cells[1:3], cells[5] = ["+99.9", "[+98.0, +99.9]"], "inconclusive"  # estimate, interval, Holm-adjusted
    changed = dict(report) | {title: report[title].replace(row, " | ".join(cells))}
    assert ("(2)", "+99.9 [+98.0, +99.9] on math (reproduces; after Holm inconclusive)") in claim_phrases(changed)
    assert count_phrase(changed) != count_phrase(report)


def test_methods_md_says_what_the_hold_grid_found():
    """docs/methods.md's routing-kd section carries the grid's finding: the overlap and OOD claims on each set."""
    _, _, _, report = grid_section("hold", TITLE)
    methods = flat((DOCS / "methods.md").read_text())
    assert "](results/hold/tables.md)" in methods
    for row in claims(report):
        if row["claim (the grid's)"].startswith(("(1)", "(2)")):
            assert quoted(row) in methods, row["claim (the grid's)"]
