"""Figures in prose come from data: the headline grid's numbers in the README and docs/toyworld.md are checked
against the shipped report (docs/results/headline/tables.md, itself regenerated from the shipped cells by
tests/project/test_shipped_results.py), so rerunning the grid makes the prose fail here until it is updated.
Results whose cells are not shipped are marked "not reproducible from the repository" where they are quoted;
only the named exceptions below may be."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
TABLES = (ROOT / "docs" / "results" / "headline" / "tables.md").read_text()
README = (ROOT / "README.md").read_text()
TOYWORLD = (ROOT / "docs" / "toyworld.md").read_text()
MARK = "not reproducible from the repository"
#: the sections of docs/toyworld.md whose results have no shipped cells, each marked so
EXCEPTIONS = ("## The demo", "## Long reasoning traces: the `cot` grid", "## Earlier results: one base")


def sections(text: str, level: str) -> dict[str, str]:
    """Heading (without its hashes) -> body, for every heading of exactly ``level`` hashes."""
    parts = re.split(rf"^{level} (.+)$", text, flags=re.M)
    return {title.strip(): body.strip() for title, body in zip(parts[1::2], parts[2::2], strict=True)}


def table_rows(body: str) -> list[dict[str, str]]:
    """A markdown table's body, row by row: {column: cell}."""
    lines = [ln for ln in body.splitlines() if ln.startswith("|")]
    header = [c.strip() for c in lines[0].strip("|").split("|")]
    return [dict(zip(header, [c.strip() for c in ln.strip("|").split("|")], strict=True)) for ln in lines[2:]]


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
    """'-1.5 [-2.3, -0.6]' -> '1.5 [0.6, 2.3]' (the README says "below")."""
    est, lo, hi = (float(x) for x in re.findall(r"[-+]?\d+\.\d+", interval))
    return f"{-est:.1f} [{-hi:.1f}, {-lo:.1f}]"


def readme_figures() -> list[tuple[str, str]]:
    """(what the README must say, where it comes from) for each headline figure it quotes."""
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
def test_each_headline_figure_in_the_readme_is_the_shipped_reports(phrase, source):
    assert flat(phrase) in flat(README), f"README does not say {phrase!r} ({source} in docs/results/headline/tables.md)"


def test_the_readmes_verdicts_are_the_shipped_reports():
    claims = table("The paper's claims, judged by rule (docs/toyworld.md)")
    verdicts = {row["verdict"] for row in claims.values()}
    assert "reproduces" not in verdicts and "no claim of the paper reproduces" in flat(README)
    beta_rule = rows(
        "The beta rule against the best beta the grid ran (criterion: mean of ID and OOD on the validation part; "
        "base 0 is in-sample: the rule was written knowing it)"
    )
    agree = sum(row["agrees"] == "yes" for row in beta_rule)
    assert len(beta_rule) == 6 and {row["betas compared"] for row in beta_rule} == {"0, 0.25, 1"}
    assert f"within noise of the best of the betas run (0, 0.25, 1) on {agree} of six base-and-set pairs" in flat(
        README
    )
    (miss,) = [row for row in beta_rule if row["agrees"] == "no"]  # the README names the one pair that disagrees
    regret = miss["regret (points) [95% CI over seeds]"].replace("+", "")
    assert f"base {miss['base']}'s math set preferred beta {miss['best beta']} by {regret} points" in flat(README)


def test_the_headline_tables_in_docs_toyworld_are_the_shipped_reports():
    shipped = sections(TABLES, "###")
    quoted = sections(TOYWORLD.split("## The headline grid: three bases", 1)[1].split("\n## ", 1)[0], "####")
    assert quoted and set(quoted) <= set(shipped)
    for title, body in quoted.items():
        if title.startswith("The paper's claims"):  # the claims this grid does not run are left out
            rows = [ln for ln in body.splitlines() if ln.startswith("|")]
            assert all(ln in shipped[title].splitlines() for ln in rows), title
        else:
            assert body == shipped[title], title


def test_results_without_shipped_cells_are_marked_where_quoted():
    for heading in EXCEPTIONS:
        body = TOYWORLD.split(heading, 1)[1].split("\n## ", 1)[0]
        assert MARK in flat(body), heading
    # the README quotes the cot grid, whose cells are not shipped
    cot = README.split("On long traces (the `cot` grid", 1)[1].split("\n\n", 1)[0]
    assert MARK in flat(cot)
    assert flat(README).count(MARK) + flat(TOYWORLD).count(MARK) == 1 + len(EXCEPTIONS)  # nothing else may be


@pytest.mark.parametrize(
    ("page", "figure", "typo"),
    [("README", "0.8 [-0.1, 1.6]", "0.9 [-0.1, 1.6]"), ("README", "80–83%", "80–84%"),
     ("TOYWORLD", "| rpb | 73.2 ± 0.9 |", "| rpb | 73.3 ± 0.9 |")],
)  # fmt: skip
def test_mutant_figure_edited_without_the_data_is_caught(page, figure, typo, monkeypatch):
    text = globals()[page]
    assert figure in text
    monkeypatch.setitem(globals(), page, text.replace(figure, typo))

    def readme():
        for phrase, source in readme_figures():
            test_each_headline_figure_in_the_readme_is_the_shipped_reports(phrase, source)

    with pytest.raises(AssertionError):
        (test_the_headline_tables_in_docs_toyworld_are_the_shipped_reports if page == "TOYWORLD" else readme)()


def test_the_headline_sections_prose_is_the_shipped_grid():
    """The cell count and the weight each base's selection chose, as docs/toyworld.md states them."""
    import json

    shipped = ROOT / "docs" / "results" / "headline"
    chosen = [json.loads((shipped / f"base{b}" / "selection.json").read_text())["chosen"]["lbl"] for b in range(3)]
    cells = len(list(shipped.glob("base*/runs/*/*/seed*/result.json")))
    section = flat(TOYWORLD.split("## The headline grid: three bases", 1)[1].split("####", 1)[0])
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


def grid_section(name: str, title: str, quoted_tables: int) -> tuple[Path, list[int], str, dict[str, str]]:
    """A three-base grid's section of docs/toyworld.md, checked against its shipped report: the tables it quotes
    (above its "**What ..." prose) are the report's, its heading says which bases are shipped while the grid
    is under way, and it counts the shipped cells. Returns the shipped folder, bases, the section's text and
    the report's tables."""
    shipped = ROOT / "docs" / "results" / name
    report = sections((shipped / "tables.md").read_text(), "###")
    heading, body = TOYWORLD.split(f"## {title}", 1)[1].split("\n## ", 1)[0].split("\n", 1)
    quoted = sections(body.split("**What ", 1)[0], "####")
    assert len(quoted) == quoted_tables and all(report[t] == table for t, table in quoted.items())
    bases = sorted(int(p.name.removeprefix("base")) for p in shipped.glob("base*") if p.is_dir())
    cells = len(list(shipped.glob("base*/runs/*/*/seed*/result.json")))
    under_way = shipped_so_far(bases)
    assert heading.strip() == (f"(under way: {under_way})" if under_way else "")
    assert f"Shipped so far: {cells} cells" in flat(body) or (not under_way and f"all {cells} cells" in flat(body))
    return shipped, bases, body, report


def test_the_beta_grids_section_is_its_shipped_report():
    """The beta grid's tables in docs/toyworld.md are its shipped report's, its heading and cell count follow the
    bases shipped, and the cross-machine agreement it states is computed from both grids' shipped cells."""
    import json

    shipped, bases, body, _ = grid_section("beta", "The beta grid: six betas", quoted_tables=5)
    beta = json.loads((shipped / "results.json").read_text())
    headline = json.loads((ROOT / "docs" / "results" / "headline" / "results.json").read_text())
    gaps = []
    for here, there in (("rpb beta=0", "sft"), ("rpb beta=1", "rpb")):
        for r in (r for r in beta if r["arm"] == here and r["set"] == "math_post"):
            key = (there, r["base"], "math_post", r["seed"])
            (h,) = [x for x in headline if (x["arm"], x["base"], x["set"], x["seed"]) == key]
            gaps.append(abs(100 * (r["id"] - h["id"])))
    assert len(gaps) == 6 * len(bases) and f"differ by at most {max(gaps):.1f} points seed by seed" in flat(body)


def test_the_readmes_beta_grid_figures_are_its_shipped_reports():
    """The README's beta-grid sentence: the pooled math differences, the code cost at beta 4, and the rule's
    agreement over the (base, set) pairs shipped, with every pair it disagrees on named, from the report."""
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
        assert flat(phrase) in flat(README), phrase


def test_the_full_grids_section_is_its_shipped_report():
    """The full grid's tables in docs/toyworld.md are its shipped report's; the weights each shipped base's
    selection chose and the count of verdicts it states are the shipped files'; no claim is left "not run"."""
    import json
    from collections import Counter

    shipped, bases, body, report = grid_section("full", "The full grid: every method", quoted_tables=5)
    text = flat(body).lower()
    for b in bases:
        chosen = json.loads((shipped / f"base{b}" / "selection.json").read_text())["chosen"]
        assert f"base {b}'s selection chose " + ", ".join(f"{w:g} for `{m}`" for m, w in sorted(chosen.items())) in text
    claims = table_rows(report[next(t for t in report if t.startswith("The paper's claims"))])
    plain, holm = Counter(r["verdict"] for r in claims), Counter(r["Holm-adjusted"] for r in claims)
    assert plain["not run"] == 0 and len(claims) == 36
    under_way = shipped_so_far(bases)
    assert (f"is under way ({under_way} shipped)" in flat(README)) == bool(under_way)
    for phrase in [] if under_way else full_readme_phrases(report, holm):
        assert flat(phrase) in flat(README), phrase
    # base 2's runs on the lent machine: the torch build each one records
    builds = [json.loads(p.read_text()).get("torch", "") for p in shipped.glob("**/base2/**/result.json")]
    lent = sum(b.startswith("2.11") for b in builds)
    assert lent and f"first {lent} ran in 16 one-thread lanes on a 16-core Intel Xeon under torch 2.11" in flat(
        TOYWORLD
    )
    assert flat(
        f"Of the {len(claims)} claims judged, {plain['reproduces']} reproduce, {plain['contradicted']} are "
        f"contradicted and {plain['inconclusive']} inconclusive (after Holm's adjustment: {holm['reproduces']}, "
        f"{holm['contradicted']} and {holm['inconclusive']})"
    ) in flat(body)


def full_readme_phrases(report: dict[str, str], holm: dict[str, int]) -> list[str]:
    """What the README must say of the whole full grid: rpb minus sft in domain on each set, and the claims'
    verdicts after Holm's adjustment, from its shipped report."""

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
    README (so the README check cannot pass against stale figures)."""
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
