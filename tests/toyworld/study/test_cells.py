"""The toy-world study at miniature size: a grid runs, resumes after kill -9 to the same tables, and refuses
a changed set-up; evaluation splits and tables against hand computations."""

import itertools
import json
import re
import shutil
from dataclasses import replace
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from rpb.anchors import AnchorConfig
from rpb.anchors.methods import get_method
from rpb.toyworld.grids import grids
from rpb.toyworld.study.cells import GridChangedError, Study
from rpb.toyworld.study.grid import Arm
from rpb.toyworld.study.tables import table
from rpb.toyworld.world.generators import POST_SETS
from rpb.toyworld.world.post import PostRecipe, eval_tasks, part_of, probe_tasks
from rpb.toyworld.world.tasks import DOMAINS, sample, split_of
from tests.toyworld_mini import MINI_GRID, MINI_POST, kill_after_first_cell, mini_study

GRIDS = grids()


def _without_timing(results):
    return [{k: v for k, v in r.items() if k != "seconds"} for r in results]


def _results(out: Path):
    return _without_timing(json.loads((out / "results.json").read_text()))


@pytest.fixture(scope="module")
def finished(tmp_path_factory):
    """One uninterrupted miniature study (its base is built into a shared cache)."""
    root = tmp_path_factory.mktemp("study")
    study = mini_study(root / "a", root / "cache")
    results = study.run()
    # the run records its weight selection itself: a share of a grid (--bases) makes no report
    selection = root / "a" / "selection.json"
    after_run = selection.read_text() if selection.is_file() else None
    tables = study.report(results)
    return root, tables, after_run


def test_miniature_grid_writes_tables_results_and_plots(finished):
    root, tables, _ = finished
    out = root / "a"
    results = _results(out)
    assert [(r["arm"], r["seed"], r["part"]) for r in results] == [("lbl", 42, "test"), ("rpb", 42, "test")]
    for r in results:
        assert (
            r["mechanism"]["start_displacement"] is None
            if r["method"] == "lbl"
            else 0 <= r["mechanism"]["start_displacement"] <= 1
        )
        assert set(r["per_domain"]) == {"math_post", *DOMAINS}
        assert r["id"] == r["per_domain"]["math_post"]
        assert r["ood"] == pytest.approx(sum(r["per_domain"][d] for d in DOMAINS) / 4)
        assert set(r["retention"]) == {"tvd", "jsd", "topk_overlap", "nmi"}
        assert 0 <= r["retention"]["tvd"] <= 1 and 0 <= r["retention"]["topk_overlap"] <= 1
        assert r["threads"] == torch.get_num_threads()  # what a bit-identical redo needs besides the machine
        # the cell's own retention report, as `rpb retention` writes it
        report = json.loads(
            (out / "runs" / "math_post" / r["arm"] / "seed42" / "retention" / "report.json").read_text()
        )
        assert report["mean"]["tvd"] == r["retention"]["tvd"]
        assert not (out / "runs" / "math_post" / r["arm"] / "seed42" / "model").exists()  # checkpoints dropped
    assert (out / "tradeoff.png").stat().st_size > 0 and (out / "retention.png").stat().st_size > 0
    assert tables in (out / "tables.md").read_text()
    assert "| lbl |" in tables and "| rpb |" in tables
    base = json.loads((out / "base_scores" / "math_post.json").read_text())
    assert f"| *base (before post-training)* | {100 * base['id']:.1f} | {100 * base['ood']:.1f} | — | — | — |" in tables


def test_weights_are_chosen_on_the_validation_split(finished):
    root, _, after_run = finished
    assert after_run == (root / "a" / "selection.json").read_text()  # written by the run, not by its report
    sel = json.loads(after_run)
    assert sel["part"] == "validation" and [t["weight"] for t in sel["trials"]] == [0.01, 0.1]
    score = {t["weight"]: (t["id"] + t["ood"]) / 2 for t in sel["trials"]}
    best = max(score.values())
    assert sel["chosen"]["lbl"] == min(w for w, s in score.items() if s == best)  # ties: the weaker anchor
    for w in (0.01, 0.1):
        trial = json.loads((root / "a" / "selection" / f"lbl-{w:g}" / "result.json").read_text())
        assert trial["part"] == "validation" and trial["anchor"] == {"lbl_coef": w} and "retention" not in trial
    used = [r for r in _results(root / "a") if r["arm"] == "lbl"]
    assert used[0]["anchor"] == {"lbl_coef": sel["chosen"]["lbl"]}


def test_a_cell_never_touches_another_methods_selection_runs(tmp_path, monkeypatch):
    """Lanes run one method's selection runs while another method's cells start: a cell that asked for every
    method's weight would start another lane's running selection run over in the same folder (as it did on 16
    lanes: the folder removed under it, two processes training into one)."""
    import rpb.toyworld.study.cells as experiment

    st = Study(tmp_path, GRIDS["full"])
    for method, weights in st.grid.candidates.items():
        for w in weights:
            where = tmp_path / "selection" / f"{method}-{w:g}"
            where.mkdir(parents=True)
            if method == "lbl":  # finished: lbl's cells may start
                (where / "result.json").write_text(json.dumps({"id": w, "ood": 0.5}))
            else:  # running in another lane
                (where / "model").mkdir()
                (where / "model" / "log.jsonl").write_text("{}\n")
    cell = tmp_path / "runs" / "math_post" / "lbl" / "seed42"
    cell.mkdir(parents=True)
    (cell / "result.json").write_text(json.dumps({"arm": "lbl", "id": 0.5}))

    def trained(*args, **kwargs):
        raise AssertionError("a selection run was started from a cell")

    monkeypatch.setattr(experiment, "train_cell", trained)
    lbl = next(a for a in st.grid.arms if a.method == "lbl")
    assert st.grid_cell("math_post", lbl, 42) == {"arm": "lbl", "id": 0.5}
    assert sorted(p.parent.parent.name for p in (tmp_path / "selection").glob("*/model/log.jsonl")) == sorted(
        f"{m}-{w:g}" for m, ws in st.grid.candidates.items() if m != "lbl" for w in ws
    )
    assert not (tmp_path / "selection.json").exists()  # recorded once every method's runs are finished
    # the weight the cell was given: lbl's best on validation (ties to the weaker), here the largest
    assert st.select_weights(experiment._NoBar(), only="lbl") == {"lbl": max(st.grid.candidates["lbl"])}


def test_killed_mid_run_resumes_to_the_same_tables(finished):
    root, tables, _ = finished
    out = root / "b"
    assert kill_after_first_cell(out, root / "cache") < 4

    study = mini_study(out, root / "cache")
    assert study.report(study.run()) == tables
    assert (out / "tables.md").read_text() == (root / "a" / "tables.md").read_text()
    assert _results(out) == _results(root / "a")


def test_a_changed_set_up_is_refused(finished, tmp_path):
    root, _, _ = finished
    cache = root / "cache"
    pinned = (root / "a" / "grid.json").read_text()
    with pytest.raises(GridChangedError, match="post_recipe"):
        Study(root / "a", MINI_GRID, replace(MINI_POST, max_steps=4), cache_dir=cache).pin()
    with pytest.raises(GridChangedError, match="grid"):
        Study(root / "a", replace(MINI_GRID, seeds=(42, 43)), MINI_POST, cache_dir=cache).pin()
    # same recipe, other weights (a base rebuilt elsewhere): a resume must not mix two bases
    other = tmp_path / "cache"
    shutil.copytree(cache, other)
    (weights,) = other.glob("toyworld/base-*/model.safetensors")
    tensors = load_file(weights)
    name = sorted(tensors)[0]
    tensors[name] = tensors[name] + 1e-3
    save_file(tensors, weights, metadata={"format": "pt"})
    with pytest.raises(GridChangedError, match=r"base_sha256 \(the base model's weights\)"):
        Study(root / "a", MINI_GRID, MINI_POST, cache_dir=other).pin()
    assert (root / "a" / "grid.json").read_text() == pinned


def test_evaluation_parts_are_disjoint_held_out_and_fixed():
    params = MINI_POST.base.domain_params()
    for domain in (*DOMAINS, *POST_SETS):
        val, test = (eval_tasks(domain, p, 40, params) for p in ("validation", "test"))
        assert val and test and val == eval_tasks(domain, "validation", 40, params)
        assert {split_of(t) for t in val + test} == {"heldout"}
        assert not {t.question for t in val} & {t.question for t in test}
        assert {part_of(t) for t in val} == {"validation"} and {part_of(t) for t in test} == {"test"}
    facts = eval_tasks("facts", "validation", 1000, params) + eval_tasks("facts", "test", 1000, params)
    assert len(facts) == 150  # every held-out phrasing of the 50-entity knowledge base, once
    train = {t.question for t in sample("math_post", 2000, seed=0)}
    assert not train & {t.question for t in eval_tasks("math_post", "test", 100, params)}
    probe = probe_tasks(MINI_POST)
    assert {t.domain for t in probe} == {*DOMAINS, *POST_SETS} and len(probe) == 24


def test_tables_show_mean_and_sample_std_over_seeds():
    def result(arm, seed, id_, ood, tvd):
        return {
            "set": "math_post",
            "arm": arm,
            "method": arm,
            "seed": seed,
            "id": id_,
            "ood": ood,
            "retention": {"tvd": tvd, "topk_overlap": 0.5, "nmi": 1.0, "jsd": 0.1},
        }

    results = [
        result("sft", 1, 0.5, 0.2, 0.3),
        result("sft", 2, 0.7, 0.4, 0.5),
        result("rpb", 1, 0.9, 0.8, 0.1),
        result("rpb-hard", 1, 0.1, 0.1, 0.1),
    ]
    text = table("forms", results, ("math_post",), ("sft", "rpb", "rpb-hard"))
    rows = [line for line in text.splitlines() if line.startswith("| ") and "method" not in line]
    # grid order, and only the methods the methods table lists among the forms (not rpb-hard);
    # sft: mean 60.0, sample std sqrt(((50-60)^2 + (70-60)^2) / 1) = 14.142...
    assert rows == [
        "| sft | 60.0 ± 14.1 | 30.0 ± 14.1 | 0.400 ± 0.141 | 0.500 ± 0.000 |",
        "| rpb | 90.0 | 80.0 | 0.100 | 0.500 |",
    ]
    main = table("main", results, ("math_post",), ("sft", "rpb", "rpb-hard"))
    assert "| rpb-hard | 10.0 | 10.0 |" in main


DOCS = Path(__file__).resolve().parents[3] / "docs" / "toyworld.md"


def _section(text: str, heading: str) -> str:
    """The text under ``heading`` up to the next heading of the same or a higher level."""
    level = heading.split(" ")[0]
    start = text.index(f"\n{heading}\n") + len(heading) + 2
    ends = [m.start() for m in re.finditer(r"\n(#+) ", text[start:]) if len(m.group(1)) <= len(level)]
    return text[start : start + ends[0]] if ends else text[start:]


def _table(section: str) -> list[list[str]]:
    """The first markdown table's body rows, as lists of cells (an escaped \\| stays inside its cell)."""
    lines = section.splitlines()
    first = next(i for i, line in enumerate(lines) if line.startswith("|"))
    rows = list(itertools.takewhile(lambda line: line.startswith("|"), lines[first:]))
    return [[c.strip() for c in re.split(r"(?<!\\)\|", row)[1:-1]] for row in rows[2:]]


def _documented_arm(item: str, default_beta: float) -> tuple[str, float | str]:
    """``(method, beta)`` of one arm as the grids table writes it."""
    if m := re.fullmatch(r"`([\w-]+)` at the calibrated beta", item):
        return m.group(1), "calibrated"
    if m := re.fullmatch(r"`([\w-]+)` \(beta ([\d.]+)\)", item):
        return m.group(1), float(m.group(2))
    m = re.fullmatch(r"`([\w-]+)`", item)
    assert m, f"unreadable arm in the docs: {item!r}"
    return m.group(1), default_beta


def documented_grids(text: str) -> dict[str, dict]:
    """What docs/toyworld.md states about each grid: its arms, seeds, sets, bases, cells, selection runs."""
    default_beta = float(re.search(r"`rpb` anchors at beta ([\d.]+)", text).group(1))
    roles = {row[0]: row[2] for row in _table(text[: text.index("\n## ")])}  # the domains table
    post_sets = tuple(d for d, role in roles.items() if role.startswith("post-training set"))
    trace_sets = tuple(d for d, role in roles.items() if role.startswith("long-trace set"))
    grids = {}
    for name, runs, _ in _table(_section(text, "## The experiment grids")):
        arms_text, seeds_text, sets_text, rest = runs.split(" × ")
        grid: dict = {"arms": None, "n_arms": None}
        if m := re.fullmatch(r"(\d+) methods", arms_text):
            grid["n_arms"] = int(m.group(1))
        elif m := re.fullmatch(r"`([\w-]+)` at beta ([\d., ]+) and `([\w-]+)`", arms_text):
            betas = [float(b) for b in m.group(2).split(", ")]
            grid["arms"] = [(m.group(1), b) for b in betas] + [(m.group(3), default_beta)]
        else:
            grid["arms"] = [_documented_arm(item, default_beta) for item in arms_text.split(", ")]
        if m := re.fullmatch(r"(\d+) seeds(?: \((\d+)–(\d+)\))?", seeds_text):
            grid["n_seeds"] = int(m.group(1))  # the seeds themselves where the row names them
            grid["seeds"] = tuple(range(int(m.group(2)), int(m.group(3)) + 1)) if m.group(2) else None
        else:
            grid["seeds"] = (int(re.fullmatch(r"seed (\d+)", seeds_text).group(1)),)
            grid["n_seeds"] = 1
        if m := re.fullmatch(r"(\d+) sets", sets_text):
            assert int(m.group(1)) == len(post_sets), sets_text
            grid["sets"] = post_sets
        elif sets_text == "the long-trace set":
            grid["sets"] = trace_sets
        else:
            prefix = re.fullmatch(r"(\w+) set", sets_text).group(1)
            grid["sets"] = tuple(d for d in post_sets if d.startswith(prefix))
        m = re.match(r"(\d+) bases|base (\d+)", rest)
        grid["bases"] = tuple(range(int(m.group(1)))) if m.group(1) else (int(m.group(2)),)
        cells = re.search(r"= (\d+)", rest)
        grid["cells"] = int(cells.group(1)) if cells else None
        selection = re.search(r"plus (\d+) (?:weight-)?selection runs", rest)
        grid["selection runs"] = int(selection.group(1)) if selection else 0
        grids[name.strip("`")] = grid
    return grids


def _arm_key(arm) -> tuple[str, float | str]:
    return arm.method, "calibrated" if arm.calibrated else dict(arm.anchor).get("beta", AnchorConfig().beta)


def _selection_runs(grid) -> int:
    """Each weighted method tries its candidate weights once per base, unless the grid fixes the weights."""
    if grid.coefficients is not None:
        return 0
    weighted = {a.method for a in grid.arms if get_method(a.method).coefficient}
    return sum(len(grid.candidates[m]) for m in weighted) * len(grid.bases)


def check_grids_match_docs() -> None:
    text = DOCS.read_text()
    flat = " ".join(text.split())  # for phrases, whatever the line wrapping
    documented = documented_grids(text)
    # the grids the paper's report makes (a grid with a report of its own has its own page)
    paper = {name for name, g in GRIDS.items() if g.report is None}
    assert set(documented) == paper - {"demo"}, "every grid but the demo is in the docs' grids table"
    default_beta = float(re.search(r"`rpb` anchors at beta ([\d.]+)", text).group(1))
    assert AnchorConfig().beta == default_beta
    for name, doc in documented.items():
        grid = GRIDS[name]
        if doc["arms"] is None:
            assert len(grid.arms) == doc["n_arms"], name
        else:
            assert [_arm_key(a) for a in grid.arms] == doc["arms"], name
        assert (len(grid.seeds), grid.sets, grid.bases) == (doc["n_seeds"], doc["sets"], doc["bases"]), name
        assert doc["seeds"] in (None, grid.seeds), name
        cells = len(grid.sets) * len(grid.arms) * len(grid.seeds) * len(grid.bases)
        if doc["cells"] is not None:
            assert cells == doc["cells"], name
        code_runs = _selection_runs(grid)
        assert code_runs == doc["selection runs"], name
    # the full grid's 11 methods are the rows of the earlier full grid's main results table
    archive = (DOCS.parent / "results" / "archive" / "one-base.md").read_text()
    main_rows = [row[0] for row in _table(_section(archive, "## Main results")) if not row[0].startswith("*")]
    assert [a.label for a in GRIDS["full"].arms] == main_rows
    # the three-base grids' study recipe: 500 ID / 300 OOD test questions, the validation part scored too
    recipe = re.search(r"(\d+) held-out test questions per post-training set \(ID\),\s+(\d+) per pretraining", text)
    assert "every cell scored on the *validation* questions as well" in flat
    for name, doc in documented.items():
        if len(doc["bases"]) == 3:
            post = GRIDS[name].post
            assert (post.eval_id, post.eval_ood) == (int(recipe.group(1)), int(recipe.group(2))), name
            assert post.score_parts == ("validation", "test"), name
    # the demo: sft, lbl at a fixed weight, rpb and the calibrated arm, one seed on the math set, 100 questions
    demo_text, demo = _section(text, "## The demo"), GRIDS["demo"]
    rows = [row[0] for row in _table(demo_text) if not row[0].startswith("*")]
    assert [_arm_key(a) for a in demo.arms] == [(m, default_beta) for m in rows] + [("rpb", "calibrated")]
    lbl = float(re.search(r"`lbl` \(weight ([\d.]+), the pretraining's; fixed", demo_text).group(1))
    assert demo.coefficients == {"lbl": lbl}
    assert "One seed on one set" in demo_text and len(demo.seeds) == 1 and demo.bases == (0,)
    assert "the prior of the base over the math set" in flat and demo.sets == ("math_post",)
    sizes = re.search(r"held-out test questions \((\d+)\)\. \*\*OOD\*\*.*?\((\d+) each;", text, re.S)
    post = demo.post or PostRecipe()  # None: the demo keeps PostRecipe()
    assert (post.eval_id, post.eval_ood) == (int(sizes.group(1)), int(sizes.group(2)))


def test_the_grids_are_what_the_docs_say():
    check_grids_match_docs()


UNCALIBRATED = Arm("rpb calibrated", "rpb")  # the label kept, the calibration lost


@pytest.mark.parametrize(
    "bug",
    [
        lambda g: {**g, "full": replace(g["full"], seeds=(42, 43))},
        lambda g: {**g, "beta": replace(g["beta"], arms=g["beta"].arms[:-2] + g["beta"].arms[-1:])},
        lambda g: {
            **g,
            "headline": replace(g["headline"], arms=(*g["headline"].arms[:3], UNCALIBRATED)),
        },
        lambda g: {**g, "cot": replace(g["cot"], candidates={**g["cot"].candidates, "lbl": (0.01, 0.1)})},
        lambda g: {**g, "demo": replace(g["demo"], coefficients={"lbl": 0.1})},
    ],
    ids=["seed_dropped", "beta_arm_dropped", "calibrated_flag_lost", "candidate_dropped", "demo_weight"],
)
def test_mutant_grid_changed_alone_is_caught(bug, monkeypatch):
    for name, grid in bug(dict(GRIDS)).items():
        monkeypatch.setitem(GRIDS, name, grid)
    with pytest.raises(AssertionError):
        check_grids_match_docs()


@pytest.mark.parametrize(
    ("stated", "edited"),
    [("3 bases = 198", "3 bases = 200"), ("`rpb` at beta 0, 0.25, 0.5, 1, 2, 4", "`rpb` at beta 0, 0.25, 0.5, 1, 2")],
    ids=["cell_count", "beta_list"],
)
def test_mutant_docs_changed_alone_is_caught(stated, edited, tmp_path, monkeypatch):
    text = DOCS.read_text()
    assert stated in text
    (tmp_path / "toyworld.md").write_text(text.replace(stated, edited))
    monkeypatch.setattr(f"{__name__}.DOCS", tmp_path / "toyworld.md")
    with pytest.raises(AssertionError):
        check_grids_match_docs()
