"""Figures in prose come from data: the grids' numbers quoted in the README, docs/study.md and docs/toyworld.md are
checked against the shipped reports (docs/results/<grid>/tables.md, themselves regenerated from the shipped cells
by tests/project/test_shipped_results.py), so rerunning a grid makes the prose fail here until it is updated.
The reports are linked, never copied. Results whose cells are not shipped are marked "not reproducible from the
repository" where they are quoted; only the named exceptions below may be."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
DOCS = ROOT / "docs"
TABLES = (DOCS / "results" / "headline" / "tables.md").read_text()
README = (ROOT / "README.md").read_text()
TOYWORLD = (DOCS / "toyworld.md").read_text()
#: what each grid found, in prose (the README's verdict lines stand on it)
STUDY = (DOCS / "study.md").read_text()
COT = (DOCS / "cot.md").read_text()
ARCHIVE = (DOCS / "results" / "archive" / "one-base.md").read_text()
MARK = "not reproducible from the repository"
#: the results with no shipped cells, each marked where quoted: (page, the section or paragraph that quotes them)
EXCEPTIONS = (
    ("STUDY", "On long traces (the `cot` grid"),
    ("COT", "# Long reasoning traces: the `cot` grid"),
    ("ARCHIVE", "# Archive: one base"),
    ("ARCHIVE", "## The demo before the shipped bases"),
)
GRIDS = ("headline", "beta", "full")
#: the grids with a line in the README's verdict paragraph: the study's, the frequency-prior grid, the
#: reinforcement-learning grid, the revert grid, the hold grid and the off-policy RL grid
VERDICT_GRIDS = (*GRIDS, "beta-frequency", "rl", "revert", "hold", "rl-stale", "hold-target", "hold-stored")


def sections(text: str, level: str) -> dict[str, str]:
    """Heading (without its hashes) -> body, for every heading of exactly ``level`` hashes."""
    parts = re.split(rf"^{level} (.+)$", text, flags=re.M)
    return {title.strip(): body.strip() for title, body in zip(parts[1::2], parts[2::2], strict=True)}


def table_rows(body: str) -> list[dict[str, str]]:
    """A markdown table's body, row by row: {column: cell}."""
    lines = [ln for ln in body.splitlines() if ln.startswith("|")]
    header = [c.strip() for c in lines[0].strip("|").split("|")]
    return [dict(zip(header, [c.strip() for c in ln.strip("|").split("|")], strict=True)) for ln in lines[2:]]


def claim_rows(report: str) -> list[dict[str, str]]:
    """A grid report's table of claims (its first "### The claims" or "### The paper's claims" section), row by row."""
    body = sections(report, "###")
    return table_rows(body[next(t for t in body if t.startswith(("The paper's claims", "The claims")))])


def rows(title: str) -> list[dict[str, str]]:
    """A table of the headline grid's tables.md, row by row."""
    return table_rows(sections(TABLES, "###")[title])


def table(title: str) -> dict[str, dict[str, str]]:
    """A table of tables.md keyed by its first cell."""
    return {next(iter(r.values())): r for r in rows(title)}


def flat(text: str) -> str:
    """Line breaks and runs of spaces as one space: prose is wrapped anywhere."""
    return re.sub(r"\s+", " ", text)


def unicode_minus(text: str) -> str:
    return text.replace("-", "−")


OUTCOME = "{}: exact match, and each method minus sft on the same base and seed"
ROUTING = "{}: what the training did to the routing (content tokens, mean ± sd over cells)"
CALIBRATED = "Calibrated beta per base and set (`rpb calibrate`, rule in rpb/calibrate/rule.py)"


def negated(interval: str) -> str:
    """'-1.5 [-2.3, -0.6]' -> '1.5 [0.6, 2.3]' (the summary says "below")."""
    est, lo, hi = (float(x) for x in re.findall(r"[-+]?\d+\.\d+", interval))
    return f"{-est:.1f} [{-hi:.1f}, {-lo:.1f}]"


def summary() -> str:
    """docs/study.md's summary of every grid (its section "The study so far"), where the README's figures went."""
    return STUDY.split("## The study so far", 1)[1].split("\n## ", 1)[0]


def readme_figures() -> list[tuple[str, str]]:
    """(what docs/study.md's summary must say, where it comes from) for each headline figure it quotes."""
    math, code = table(OUTCOME.format("math_post")), table(OUTCOME.format("code_post"))
    displaced = [float(table(ROUTING.format(s))["rpb"]["displaced before training"].split(" ± ")[0]) for s in
                 ("math_post", "code_post")]  # fmt: skip
    betas = {v for row in table(CALIBRATED).values() for k, v in row.items() if k != "base"}
    (beta,) = betas
    return [
        (f"(`sft` {math['sft']['ID %']}% ID)", "math_post, sft, ID %"),
        (
            f"`rpb` at the paper's beta 1 is {negated(code['rpb']['Δ ID vs sft [95% CI]'])} points below `sft`",
            "code_post rpb ΔID",
        ),
        (f"it is level ({unicode_minus(code['rpb calibrated']['Δ ID vs sft [95% CI]'])})", "code_post calibrated ΔID"),
        (f"({beta} on every base)", "calibrated beta table"),
        (f"{round(min(displaced) * 100)}–{round(max(displaced) * 100)}% of content tokens", "displaced, rpb"),
    ]


@pytest.mark.parametrize(("phrase", "source"), readme_figures(), ids=[s for _, s in readme_figures()])
def test_each_headline_figure_in_the_study_is_the_shipped_reports(phrase, source):
    assert flat(phrase) in flat(summary()), (
        f"study.md's summary does not say {phrase!r} ({source} in docs/results/headline/tables.md)"
    )


def test_the_studys_headline_verdicts_are_the_shipped_reports():
    claims = table("The paper's claims, judged by rule (docs/toyworld.md)")
    verdicts = {row["verdict"] for row in claims.values()}
    assert "reproduces" not in verdicts and "no claim of the paper reproduces" in flat(STUDY)
    beta_rule = rows(
        "The beta rule against the best beta the grid ran (criterion: mean of ID and OOD on the validation part; "
        "base 0 is in-sample: the rule was written knowing it)"
    )
    agree = sum(row["agrees"] == "yes" for row in beta_rule)
    assert len(beta_rule) == 6 and {row["betas compared"] for row in beta_rule} == {"0, 0.25, 1"}
    assert f"within noise of the best of the betas run (0, 0.25, 1) on {agree} of six base-and-set pairs" in flat(STUDY)
    (miss,) = [row for row in beta_rule if row["agrees"] == "no"]  # the summary names the one pair that disagrees
    regret = miss["regret (points) [95% CI over seeds]"].replace("+", "")
    assert f"base {miss['base']}'s math set preferred beta {miss['best beta']} by {regret} points" in flat(STUDY)


def report_rows(text: str) -> set[str]:
    """Every data row of a report's tables (header and rule rows left out)."""
    lines = text.splitlines()
    return {ln for i, ln in enumerate(lines) if ln.startswith("| ") and i >= 2 and lines[i - 1].startswith("|")
            and not set(ln) <= set("|- ")}  # fmt: skip


def copied_rows(page: str) -> list[str]:
    """The rows of a shipped grid's report that a page copies."""
    shipped = set().union(*(report_rows((DOCS / "results" / g / "tables.md").read_text()) for g in GRIDS))
    return [ln for ln in page.splitlines() if ln in shipped]


def test_the_reports_are_linked_not_copied():
    for name in ("README", "TOYWORLD", "STUDY"):
        assert copied_rows(globals()[name]) == [], name
    for grid in GRIDS:
        link = f"](results/{grid}/tables.md)"
        assert link in TOYWORLD and link in grid_text(grid), grid


def grid_text(grid: str) -> str:
    """docs/study.md's section on one grid."""
    title = {"headline": "The headline grid: three bases", "beta": "The beta grid: six betas",
             "full": "The full grid: every method"}[grid]  # fmt: skip
    return STUDY.split(f"## {title}", 1)[1].split("\n## ", 1)[0]


def test_results_without_shipped_cells_are_marked_where_quoted():
    pages = {name: globals()[name] for name in ("README", "TOYWORLD", "STUDY", "COT", "ARCHIVE")}
    for name, start in EXCEPTIONS:
        body = pages[name].split(start, 1)[1]
        if start.startswith("## "):  # a section, to the next of its level
            body = body.split("\n## ", 1)[0]
        elif not start.startswith("# "):  # a paragraph (a page's title stands for the whole page)
            body = body.split("\n\n", 1)[0]
        assert MARK in flat(body), (name, start)
    assert sum(flat(text).count(MARK) for text in pages.values()) == len(EXCEPTIONS)  # nothing else may be


@pytest.mark.parametrize(
    ("page", "figure", "typo"),
    [("STUDY", "0.8 [-0.1, 1.6]", "0.9 [-0.1, 1.6]"), ("STUDY", "80–83%", "80–84%"),
     ("STUDY", "validation points).", "validation points).\n\n| rpb | 73.2 ± 0.9 | -0.8 [-1.6, +0.1] | b0 -1.4 / "
      "b1 -0.1 / b2 -1.0 | 27.0 ± 6.8 | -0.1 [-0.9, +0.9] | b0 -0.5 / b1 -0.4 / b2 +0.7 |\n"),
     ("README", "after Holm 6 reproduce, 0 contradicted, 30", "after Holm 7 reproduce, 0 contradicted, 29")],
)  # fmt: skip
def test_mutant_figure_edited_without_the_data_is_caught(page, figure, typo, monkeypatch):
    text = globals()[page]
    assert figure in text
    monkeypatch.setitem(globals(), page, text.replace(figure, typo, 1))

    def study():
        for phrase, source in readme_figures():
            test_each_headline_figure_in_the_study_is_the_shipped_reports(phrase, source)

    check = {"README": test_the_readmes_verdict_lines_are_the_shipped_reports, "STUDY": study}[page]
    if "| rpb |" in typo:
        check = test_the_reports_are_linked_not_copied
    with pytest.raises(AssertionError):
        check()


def verdict_line(grid: str, report: str) -> str:
    """The README's line on one grid: its judged claims' verdicts by the claim's own rule and after Holm's adjustment,
    counted from its report (both: a claim whose interval lies wholly outside its margin is contradicted by rule
    though Holm leaves it inconclusive, and the line must not read "0 contradicted" alone)."""
    from collections import Counter

    claims = [r for r in claim_rows(report) if r["Holm-adjusted"] not in ("not run", "outside Holm")]
    if not claims:  # the hold grid's (6) is reported, not counted
        return f"`{grid}` "

    def counted(column: str) -> str:
        c = Counter(r[column] for r in claims)
        return f"{c['reproduces']} reproduce, {c['contradicted']} contradicted, {c['inconclusive']} inconclusive"

    return f"of {len(claims)} claims judged: by rule {counted('verdict')}; after Holm {counted('Holm-adjusted')}."


def test_the_readmes_verdict_lines_are_the_shipped_reports():
    """One line per shipped grid, in the README's verdict list, each stating that grid's computed verdicts."""
    lines = README.split("<!-- verdicts", 1)[1].split("\n\n", 1)[0].splitlines()[1:]
    assert [ln.split("`")[1] for ln in lines] == list(VERDICT_GRIDS) and len(lines) <= 10
    for grid, line in zip(VERDICT_GRIDS, lines, strict=True):
        expected = verdict_line(grid, (DOCS / "results" / grid / "tables.md").read_text())
        assert expected in line, (grid, expected)
    assert "judges no claim" in lines[GRIDS.index("beta")]


def test_the_verdict_line_follows_its_report():
    report = (DOCS / "results" / "full" / "tables.md").read_text()
    before = verdict_line("full", report)
    (row,) = [ln for ln in report.splitlines() if ln.startswith("| within-hard well below RPB (code_post, ID)")]
    after = verdict_line(
        "full", report.replace(row, row.replace("| reproduces | reproduces |", "| reproduces | inconclusive |"))
    )
    assert before != after and "after Holm 5 reproduce, 0 contradicted, 31 inconclusive" in after


def test_the_headline_sections_prose_is_the_shipped_grid():
    """The cell count and the weight each base's selection chose, as docs/study.md states them."""
    import json

    shipped = ROOT / "docs" / "results" / "headline"
    chosen = [json.loads((shipped / f"base{b}" / "selection.json").read_text())["chosen"]["lbl"] for b in range(3)]
    cells = len(list(shipped.glob("base*/runs/*/*/seed*/result.json")))
    section = flat(grid_text("headline"))
    assert f"{cells} cells" in section
    assert ", ".join(f"{w} on base {b}" for b, w in enumerate(chosen)) in section


def shipped_so_far(bases: list[int], of: int = 3) -> str:
    """How a section under way names its shipped bases: "base 0 of 3", "bases 0 and 1 of 3"; "" when whole."""
    if len(bases) == of:
        return ""
    named = " and ".join(str(b) for b in bases)
    return f"base{'s' if len(bases) > 1 else ''} {named} of {of}"


def test_shipped_so_far_names_the_bases_in_order():
    assert [shipped_so_far(b) for b in ([0], [0, 1], [0, 1, 2])] == ["base 0 of 3", "bases 0 and 1 of 3", ""]


def grid_section(name: str, title: str) -> tuple[Path, list[int], str, dict[str, str]]:
    """A three-base grid's section of docs/study.md, checked against its shipped report: it links the report
    and copies none of its tables, its heading says which bases are shipped while the grid is under way, and it
    counts the shipped cells. Returns the shipped folder, bases, the section's text and the report's tables."""
    shipped = ROOT / "docs" / "results" / name
    report = sections((shipped / "tables.md").read_text(), "###")
    heading, body = STUDY.split(f"## {title}", 1)[1].split("\n## ", 1)[0].split("\n", 1)
    assert f"](results/{name}/tables.md)" in body and not sections(body, "####") and copied_rows(body) == []
    bases = sorted(int(p.name.removeprefix("base")) for p in shipped.glob("base*") if p.is_dir())
    cells = len(list(shipped.glob("base*/runs/*/*/seed*/result.json")))
    under_way = shipped_so_far(bases)
    assert heading.strip() == (f"(under way: {under_way})" if under_way else "")
    assert f"Shipped so far: {cells} cells" in flat(body) or (not under_way and f"all {cells} cells" in flat(body))
    return shipped, bases, body, report


def test_the_beta_grids_section_is_its_shipped_report():
    """The beta grid's section in docs/study.md links its shipped report, its heading and cell count follow the
    bases shipped, and the cross-machine agreement it states is computed from both grids' shipped cells."""
    import json

    shipped, bases, body, _ = grid_section("beta", "The beta grid: six betas")
    beta = json.loads((shipped / "results.json").read_text())
    headline = json.loads((ROOT / "docs" / "results" / "headline" / "results.json").read_text())
    gaps = []
    for here, there in (("rpb beta=0", "sft"), ("rpb beta=1", "rpb")):
        for r in (r for r in beta if r["arm"] == here and r["set"] == "math_post"):
            key = (there, r["base"], "math_post", r["seed"])
            (h,) = [x for x in headline if (x["arm"], x["base"], x["set"], x["seed"]) == key]
            gaps.append(abs(100 * (r["id"] - h["id"])))
    assert len(gaps) == 6 * len(bases) and f"differ by at most {max(gaps):.1f} points seed by seed" in flat(body)


def test_the_studys_beta_grid_figures_are_its_shipped_reports():
    """docs/study.md's beta-grid summary: the pooled math differences, the code cost at beta 4 (which the
    README's verdict line quotes too), and the rule's agreement over the (base, set) pairs shipped, with every
    pair it disagrees on named, from the report."""
    report = sections((ROOT / "docs" / "results" / "beta" / "tables.md").read_text(), "###")

    def by_arm(post_set: str) -> dict[str, list[str]]:
        title = f"{post_set}: exact match, and each method minus rpb beta=0 (sft bit for bit) on the same base and seed"
        return {ln.split(" | ")[0].strip("| "): ln.split(" | ") for ln in report[title].splitlines()
                if ln.startswith("| rpb")}  # fmt: skip

    math, code = by_arm("math_post"), by_arm("code_post")
    rule = [ln.strip("|").split(" | ") for ln in report[next(t for t in report if t.startswith("The beta rule"))]
            .splitlines() if ln.startswith("| ") and ln[2].isdigit()]  # fmt: skip
    bases = sorted({int(r[0].split()[0]) for r in rule})
    assert len(rule) == 2 * len(bases) and all(r[2].strip() == "0.25" for r in rule)  # the rule's beta everywhere
    agree = sum(r[6].strip() == "yes" for r in rule)
    phrases = [f"beta 1 is {unicode_minus(math['rpb beta=1'][2])}", f"`rpb-hard` {unicode_minus(math['rpb hard'][2])}",
               f"beta 4 {unicode_minus(code['rpb beta=4'][2])}",
               f"on {agree} of {len(rule)} base-and-set pairs"]  # fmt: skip
    phrases += [f"beta {r[4]} beat it on base {r[0].split()[0]} (by {r[5].replace('+', '')} validation points)"
                for r in rule if r[6].strip() == "no"]  # fmt: skip
    for phrase in phrases:
        assert flat(phrase) in flat(STUDY), phrase
    assert flat(phrases[2]) in flat(README)


def test_the_full_grids_section_is_its_shipped_report():
    """The full grid's section in docs/study.md links its shipped report; the weights each shipped base's
    selection chose and the count of verdicts it states are the shipped files'; no claim is left "not run"."""
    import json
    from collections import Counter

    shipped, bases, body, report = grid_section("full", "The full grid: every method")
    text = flat(body).lower()
    for b in bases:
        chosen = json.loads((shipped / f"base{b}" / "selection.json").read_text())["chosen"]
        assert f"base {b}'s selection chose " + ", ".join(f"{w:g} for `{m}`" for m, w in sorted(chosen.items())) in text
    claims = table_rows(report[next(t for t in report if t.startswith("The paper's claims"))])
    plain, holm = Counter(r["verdict"] for r in claims), Counter(r["Holm-adjusted"] for r in claims)
    assert plain["not run"] == 0 and len(claims) == 36
    under_way = shipped_so_far(bases)
    assert (f"is under way ({under_way} shipped)" in flat(STUDY)) == bool(under_way)
    for phrase in [] if under_way else full_readme_phrases(report, holm):
        assert flat(phrase) in flat(STUDY), phrase
    # base 2's runs on the lent machine: the torch build each one records
    builds = [json.loads(p.read_text()).get("torch", "") for p in shipped.glob("**/base2/**/result.json")]
    lent = sum(b.startswith("2.11") for b in builds)
    assert lent and f"first {lent} ran in 16 one-thread lanes on a 16-core Intel Xeon under torch 2.11" in flat(STUDY)
    assert flat(
        f"Of the {len(claims)} claims judged, {plain['reproduces']} reproduce, {plain['contradicted']} are "
        f"contradicted and {plain['inconclusive']} inconclusive (after Holm's adjustment: {holm['reproduces']}, "
        f"{holm['contradicted']} and {holm['inconclusive']})"
    ) in flat(body)


def full_readme_phrases(report: dict[str, str], holm: dict[str, int]) -> list[str]:
    """What docs/study.md's summary must say of the whole full grid: rpb minus sft in domain on each set, and the
    claims' verdicts after Holm's adjustment, from its shipped report."""

    def delta(post_set: str, method: str) -> str:
        (row,) = [r for r in table_rows(report[OUTCOME.format(post_set)]) if r["method"] == method]
        return unicode_minus(row["Δ ID vs sft [95% CI]"])

    return [
        f"`rpb` − `sft` in domain is {delta('math_post', 'rpb')} points on math and {delta('code_post', 'rpb')} "
        "on code",
        f"after Holm's adjustment {holm['reproduces']} of its 36 claims reproduce, {holm['contradicted']} are "
        f"contradicted and {holm['inconclusive']} inconclusive",
    ]


def test_the_full_grids_readme_phrases_follow_its_report():
    """The phrases are computed from the report: an edited figure in the report changes what is asked of the
    summary (so the summary's check cannot pass against stale figures)."""
    from collections import Counter

    report = sections((ROOT / "docs" / "results" / "full" / "tables.md").read_text(), "###")
    holm = Counter({"reproduces": 1, "contradicted": 2, "inconclusive": 33})
    before = full_readme_phrases(report, holm)
    math = OUTCOME.format("math_post")
    (rpb,) = [ln for ln in report[math].splitlines() if ln.startswith("| rpb |")]
    cells = rpb.split(" | ")
    cells[2] = "+99.9 [+98.0, +99.9]"
    report[math] = report[math].replace(rpb, " | ".join(cells))
    after = full_readme_phrases(report, holm)
    assert "+99.9 [+98.0, +99.9] points on math" in after[0] and before[0] != after[0]
    assert after[1] == "after Holm's adjustment 1 of its 36 claims reproduce, 2 are contradicted and 33 inconclusive"


def test_the_router_freeze_answer_quotes_the_full_grids_report():
    """docs/methods.md and the README say what router-freeze kept in the full grid, as its report has it."""
    report = (DOCS / "results" / "full" / "tables.md").read_text()
    rows = {}
    for line in report.splitlines():
        cells = [c.strip() for c in line.strip("|").split("|")]
        if cells[0] in ("sft", "router-freeze"):
            rows.setdefault(cells[0], []).append(cells)
    # per method: the math and code score rows, then the math and code mechanism rows (the order of the report)
    overlap = {m: [r[3].split(" ")[0] for r in rows[m][2:4]] for m in ("sft", "router-freeze")}
    ood = [r[5] for r in rows["router-freeze"][:2]]
    methods = flat((DOCS / "methods.md").read_text())
    assert overlap == {"sft": ["0.549", "0.625"], "router-freeze": ["0.565", "0.642"]}
    assert (f"{overlap['router-freeze'][0]} on math and {overlap['router-freeze'][1]} on code, against `sft`'s "
            f"{overlap['sft'][0]} and {overlap['sft'][1]}") in methods  # fmt: skip
    assert f"{ood[0].replace('-', '−')} and {ood[1].replace('-', '−')} out-of-domain points" in methods
    readme = flat(README)
    assert f"{overlap['router-freeze'][0]} / {overlap['router-freeze'][1]} against `sft`'s" in readme
