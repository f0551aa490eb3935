"""The hold-stored grid: its margins recomputed from the shipped ``hold`` grid's pairs, its copies (which shipped
cells, byte for byte, and where λ 100 wins the set cross-entropy's cells are trained instead), its route files,
its claims judged on hand-made cells, and a cell's windows read from a hand-written log."""

from __future__ import annotations

import json
import math
from pathlib import Path

import numpy as np
import pytest
from scipy.stats import t as student_t

import rpb.toyworld.grids.hold_stored as hold_stored
from rpb.toyworld.grids.hold_stored import (
    GRID,
    OOD_MARGIN,
    OVERLAP_MARGIN,
    STORED_ARMS,
    WEIGHTS,
    HoldStoredStudy,
    judge_hold_stored,
    windows,
)
from rpb.toyworld.study.grid import STUDY_POST

RESULTS = Path(__file__).resolve().parents[3] / "docs" / "results"


def stored_minus_online(metric: str, post_set: str) -> list[float]:
    """The hold grid's paired differences ``routing-kd routes`` − ``routing-kd``, in points for exact match."""
    by = {
        (r["arm"], r["set"], r["base"], r["seed"]): r for r in json.loads((RESULTS / "hold/results.json").read_text())
    }
    scale, value = (100, lambda r: r[metric]) if metric == "ood" else (1, lambda r: r["retention"][metric])
    return [
        scale * (value(by[("routing-kd routes", s, b, k)]) - value(by[("routing-kd", s, b, k)]))
        for (arm, s, b, k) in by
        if arm == "routing-kd" and s == post_set
    ]


def test_the_ood_margins_are_the_hold_pairs_sd_rounded_up_and_the_doc_states_sds_and_mdds():
    """The SD with numpy, the minimal detectable difference with scipy's t: (t_.975 + t_.8) with 8 df x SD / 3."""
    doc = " ".join(hold_stored.__doc__.split())
    factor = (student_t.ppf(0.975, 8) + student_t.ppf(0.8, 8)) / 3
    sds, mdds, overlap_sds = [], [], []
    for post_set, margin in OOD_MARGIN.items():
        d = stored_minus_online("ood", post_set)
        assert len(d) == 9
        sds.append(np.std(d, ddof=1))
        assert margin == math.ceil(sds[-1] * 10) / 10, post_set
        mdds.append(math.ceil(factor * sds[-1] * 10) / 10)
        overlap_sds.append(f"{np.std(stored_minus_online('topk_overlap', post_set), ddof=1):.3f} on {post_set}")
    assert f"({sds[0]:.3f} and {sds[1]:.3f}, so {OOD_MARGIN['math_post']:g} and {OOD_MARGIN['code_post']:g})" in doc
    assert f"is {mdds[0]:g} and {mdds[1]:g} points" in doc
    assert f"{overlap_sds[0]}, {overlap_sds[1]}" in doc
    assert OVERLAP_MARGIN == 0.05  # the hold grid's own overlap margin for the same comparison (its claim 4a)


def test_the_grid_trains_168_runs_counted_by_hand():
    """5 new arms x 2 sets x 3 seeds x 3 bases = 90 cells, 5 weights x 5 new selections x 3 bases = 75, and the set
    cross-entropy at λ 100 on each base = 3; sft, online routing-kd and the set cross-entropy's cells are copies."""
    assert [a.label for a in STORED_ARMS] == [
        "sft", "routing-kd", "routing-kd routes", "stored top-k", "stored top-2k", "stored ids hinge",
        "routing-kd-router", "hidden-kd",
    ]  # fmt: skip
    new = [a for a in STORED_ARMS if a.source is None]
    selections = {a.selection for a in new}
    assert len(new) == 5 and None not in selections and WEIGHTS == (0.01, 0.1, 1.0, 10.0, 100.0)
    copied_selection_runs = 4  # the hold grid's 0.01 to 10
    runs = len(new) * 2 * 3 * 3 + len(selections) * len(WEIGHTS) * 3 + (len(WEIGHTS) - copied_selection_runs) * 3
    assert runs == 168
    assert all(GRID.candidates[k] == WEIGHTS for k in [*selections, "routing-kd-routes"])


def _shipped(root: Path, base: str, recipe: dict) -> None:
    """A fake repository's shipped hold and hold-target bases, with this study's pins and a cell of each arm."""
    for grid, arms in (("hold", ("routing-kd", "routing-kdroutes")), ("hold-target", ("sft", "routing-kd"))):
        folder = root / grid / base
        folder.mkdir(parents=True)
        (folder / "grid.json").write_text(json.dumps(recipe | {"grid": {"name": grid}}))
        for slug in arms:
            cell = folder / "runs" / "math_post" / slug / "seed42" / "result.json"
            cell.parent.mkdir(parents=True)
            cell.write_text(json.dumps({"from": grid, "arm": slug}) + "  \n")  # odd bytes: copied, not rewritten
    trials = [{"method": "routing-kd-routes", "weight": w} for w in WEIGHTS[:4]]
    (root / "hold" / base / "selection.json").write_text(
        json.dumps({"chosen": {"routing-kd-routes": 0.01}, "t": trials})
    )
    for w in WEIGHTS[:4]:
        cell = root / "hold" / base / "selection" / f"routing-kd-routes-{w:g}" / "result.json"
        cell.parent.mkdir(parents=True)
        cell.write_text(json.dumps({"id": 0.3, "ood": 0.3 - w / 100}))


def _study(tmp_path: Path, monkeypatch, routes_100: float) -> tuple[HoldStoredStudy, list]:
    recipe = {"post_recipe": {"max_steps": 500}, "base_sha256": "abc"}
    _shipped(tmp_path / "shipped", "base0", recipe)
    study = HoldStoredStudy(tmp_path / "base0", GRID, STUDY_POST, shipped_results=tmp_path / "shipped")
    study.out.mkdir()
    (study.out / "grid.json").write_text(json.dumps(recipe | {"grid": {"name": "hold-stored"}}))
    monkeypatch.setattr(study, "routes", lambda post_set, form: Path(f"/routes/{post_set}-{form}"))
    trained = []
    real_cell = study.cell

    def cell(where, post_set, arm, seed, weight, part=None, retention=True):
        if (where / "result.json").is_file():
            return real_cell(where, post_set, arm, seed, weight, part, retention)
        trained.append((arm.label, weight, part))
        result = {"id": 0.3, "ood": routes_100} if part == "validation" else {"trained": arm.label}
        (where / "result.json").parent.mkdir(parents=True)
        (where / "result.json").write_text(json.dumps(result))  # finished, as Study.cell leaves it
        return result

    monkeypatch.setattr(study, "cell", cell)
    return study, trained


def test_copies_are_byte_for_byte_and_the_selection_reads_the_hold_grids_four_runs(tmp_path, monkeypatch):
    study, trained = _study(tmp_path, monkeypatch, routes_100=0.1)  # λ 100 loses: the hold grid's choice stands
    study.prepare()
    assert study.chosen_routes_weight() == 0.01 and trained == [("routing-kd-routes", 100.0, "validation")]
    for label, grid in (("sft", "hold-target"), ("routing-kd", "hold-target"), ("routing-kd routes", "hold")):
        (arm,) = [a for a in STORED_ARMS if a.label == label]
        got = study.grid_cell("math_post", arm, 42)
        source = tmp_path / "shipped" / grid / "base0" / "runs" / "math_post" / arm.slug / "seed42" / "result.json"
        mine = study.out / "runs" / "math_post" / arm.slug / "seed42" / "result.json"
        assert mine.read_bytes() == source.read_bytes() and got["from"] == grid
    assert [t[0] for t in trained] == ["routing-kd-routes"], "no copied cell was trained"
    study.grid_cell("math_post", STORED_ARMS[3], 42)  # a new arm: trained here at its own selection's choice
    assert trained[-1][:2] == ("stored top-k", 0.01)  # every stored-top-k validation run scored alike: the weakest


def test_where_lambda_100_wins_the_set_cross_entropy_is_trained_here_at_100(tmp_path, monkeypatch):
    study, trained = _study(tmp_path, monkeypatch, routes_100=0.9)
    study.prepare()
    (arm,) = [a for a in STORED_ARMS if a.label == "routing-kd routes"]
    assert study.grid_cell("math_post", arm, 42) == {"trained": "routing-kd routes"}
    assert trained[-1] == ("routing-kd routes", 100.0, None)
    assert [t[0] for t in trained].count("routing-kd-routes") == 1, "the selection at 100 ran once"


def test_without_a_shipped_base_of_the_same_pins_every_cell_is_trained_here(tmp_path, monkeypatch):
    study, trained = _study(tmp_path, monkeypatch, routes_100=0.1)
    (study.out / "grid.json").write_text(json.dumps({"post_recipe": {"max_steps": 500}, "base_sha256": "other"}))
    study.prepare()
    assert trained == [] and study.chosen_routes_weight() == 0.01
    assert [w for (_, w, _) in trained] == list(WEIGHTS), "the hold grid's selection runs trained too"
    study.grid_cell("math_post", STORED_ARMS[1], 42)
    assert trained[-1] == ("routing-kd", 10.0, None), "online routing-kd at the hold grid's λ on base 0"


@pytest.mark.parametrize(("form", "top_m", "transform"), [("ids", None, None), ("top-k", 6, "softmax"),
                                                          ("top-2k", 12, "softmax")])  # fmt: skip
def test_each_route_form_is_written_at_its_top_m_under_the_runs_transform(
    tmp_path, monkeypatch, form, top_m, transform
):
    import rpb.collect.hf_routes as hf_routes

    study = HoldStoredStudy(tmp_path, GRID, STUDY_POST)
    seen = {}
    monkeypatch.setattr(study, "base", lambda: tmp_path / "base")
    monkeypatch.setattr(study, "data", lambda post_set: tmp_path / f"{post_set}.jsonl")
    monkeypatch.setattr(hf_routes, "write_routes", lambda *a, **kw: seen.update(kw))
    assert study.routes("code_post", form).name == f"code_post-{form}.safetensors"
    assert (seen["top_m"], seen["probs_transform"]) == (top_m, transform)


def cells(shift: dict[str, dict[str, float]], noise: float = 0.5, seed: int = 0) -> list[dict]:
    rng = np.random.default_rng(seed)
    return [
        {
            "arm": arm, "set": "math_post", "base": base, "seed": s,
            "id": 0.7 + noise / 100 * rng.standard_normal(),
            "ood": 0.3 + shift.get(arm, {}).get("ood", 0.0) + noise / 100 * rng.standard_normal(),
            "retention": {"topk_overlap": 0.9 + shift.get(arm, {}).get("overlap", 0.0) + 0.005 * rng.standard_normal()},
        }
        for arm in (a.label for a in STORED_ARMS) for base in (0, 1, 2) for s in (42, 43, 44)
    ]  # fmt: skip


def by_claim(verdicts, number: str):
    (v,) = [v for v in verdicts if v.claim.startswith(f"({number})")]
    return v


def test_the_claims_read_their_margins_and_directions():
    # stored top-k 3 points below online OOD: inside math_post's 4.5-point margin; 0.03 below in overlap: inside 0.05
    held = judge_hold_stored(cells({"stored top-k": {"ood": -0.03, "overlap": -0.03},
                                    "routing-kd routes": {"ood": -0.15}, "stored ids hinge": {"ood": -0.05},
                                    "routing-kd-router": {"ood": -0.1}, "hidden-kd": {"ood": 0.05}}),
                             ("math_post",))  # fmt: skip
    assert [by_claim(held, n).holm for n in ("1a", "1b", "2", "3", "4")] == ["reproduces"] * 5
    assert [by_claim(held, n).holm for n in "56"] == ["outside Holm"] * 2
    assert by_claim(held, "5").verdict == by_claim(held, "6").verdict == "reproduces"  # top-2k 3 points above top-k
    # 8 points below online OOD and 0.1 in overlap: beyond the margins; the router-only control keeping more
    lost = judge_hold_stored(cells({"stored top-k": {"ood": -0.08, "overlap": -0.1}, "routing-kd-router": {"ood": 0.1},
                                    "stored ids hinge": {"ood": -0.03}}), ("math_post",))  # fmt: skip
    assert [by_claim(lost, n).verdict for n in ("1a", "1b", "2", "3", "4")] == ["contradicted"] * 5


def test_a_cells_windows_are_read_from_its_log(tmp_path):
    log = tmp_path / "log.jsonl"
    lines = [
        {"step": 10, "loss": 1.0, "moe/mean/anchor_loss": 0.004, "moe/mean/routes_hinge_active": 0.3},
        {"step": 10, "train_runtime": 5.0},
        {"step": 20, "loss": 0.9, "moe/mean/anchor_loss": 0.05},
    ]
    log.write_text("".join(json.dumps(x) + "\n" for x in lines))
    assert windows(log) == {"step": [10, 20], "anchor_loss": [0.004, 0.05], "routes_hinge_active": [0.3, None]}
