"""The long-trace grid's paired table against figures worked out by hand."""

from rpb.toyworld.study.tables import paired_table

METRICS = ("id", "nmi", "transition_nmi")


def _cell(arm: str, seed: int, id_: float, nmi: float, transition_nmi: float) -> dict:
    return {
        "set": "sum_trace",
        "arm": arm,
        "seed": seed,
        "base": 0,
        "id": id_,
        "id_lines": 0.5,
        "ood": 0.0,
        "retention": {"nmi": nmi, "transition_nmi": transition_nmi},
    }


def _rows(table: str) -> dict[str, list[str]]:
    rows = [line.strip("|").split(" | ") for line in table.splitlines() if line.startswith("| ") and " − " in line]
    return {cells[0].strip(): [c.strip() for c in cells[1:]] for cells in rows if cells[0].strip() != "arm − reference"}


def test_paired_table_against_hand_computed_differences():
    results = []
    for k, seed in enumerate((42, 43, 44)):
        results.append(_cell("sft", seed, 0.25, 0.40, 0.30))
        # rpb: +1 point ID on every seed, static NMI +0.1, transition NMI -0.05
        results.append(_cell("rpb", seed, 0.26, 0.50, 0.25))
        # lbl: +10, +20, +30 points ID; static NMI unchanged, transition NMI -0.1
        results.append(_cell("lbl", seed, 0.25 + 0.1 * (k + 1), 0.40, 0.20))
    results.append(_cell("within-soft", 42, 0.21, 0.50, 0.25))  # one seed finished so far
    pairs = (("lbl", "sft"), ("rpb", "sft"), ("within-soft", "rpb"), ("within-hard", "rpb"))
    rows = _rows(paired_table(results, "sum_trace", pairs=pairs, metrics=METRICS))
    assert set(rows) == {"lbl − sft", "rpb − sft", "within-soft − rpb"}  # a pair whose arm did not run has no row
    # one pair: its difference, no interval and no verdict
    assert rows["within-soft − rpb"] == [
        "-5.0 (one pair)",
        "+0.000 (one pair)",
        "+0.000 (one pair)",
        "one pair",
        "one pair",
    ]
    # rpb: constant differences give a zero-width interval; the 90% one lies inside +/-2 points: equivalent
    assert rows["rpb − sft"] == [
        "+1.0 [+1.0, +1.0]",
        "+0.100 [+0.100, +0.100]",
        "-0.050 [-0.050, -0.050]",
        "opposite (static up, transition down)",
        "yes",
    ]
    # lbl: 27 equally likely resamples of (10, 20, 30); a mean of 10 has probability 1/27 > 2.5%, so the
    # 95% interval is [10, 30], wholly above +2: not equivalent
    assert rows["lbl − sft"] == [
        "+20.0 [+10.0, +30.0]",
        "+0.000 [+0.000, +0.000]",
        "-0.100 [-0.100, -0.100]",
        "only transition (down)",
        "no",
    ]


def test_the_machine_mix_counts_cells_by_machine_and_threads():
    from rpb.toyworld.study.tables import machine_mix

    cells = [{"machine": "EPYC", "threads": 2}] + [{"machine": "Xeon", "threads": 1}] * 3 + [{"threads": 1}]
    assert machine_mix(cells) == (
        "Cells ran on: 3 on Xeon at 1 thread; 1 on EPYC at 2 threads; 1 on machine not recorded at 1 thread."
    )
    # the same CPU and thread count under two torch builds: two kinds of bits, each named
    cells = [{"machine": "EPYC", "threads": 1, "torch": "2.11.0"}] + [{"machine": "EPYC", "threads": 1}] * 2
    assert machine_mix(cells) == (
        "Cells ran on: 2 on EPYC at 1 thread, torch not recorded; 1 on EPYC at 1 thread with torch 2.11.0."
    )


def test_the_weights_table_lists_each_bases_choice_with_its_candidates_and_flags_the_ends(tmp_path):
    """A choice at either end of its candidates may be capped by the range (nothing beyond was tried): flagged per
    base, and the pilot's settings beside them."""
    import json
    from types import SimpleNamespace

    from rpb.toyworld.study.tables import edge_of, weights_table

    assert (edge_of(10, (0.01, 10, 1)), edge_of(0.01, (1, 0.01)), edge_of(1, (0.01, 1, 10)), edge_of(3, (3,))) == (
        "top", "bottom", "", ""
    )  # fmt: skip
    studies = []
    for b, chosen in ((0, {"kd": 10.0, "lbl": 0.01}), (1, {"kd": 1.0, "lbl": 0.001})):
        (tmp_path / f"b{b}").mkdir()
        selection = {"criterion": "mean of ID and OOD exact match", "chosen": chosen}
        (tmp_path / f"b{b}" / "selection.json").write_text(json.dumps(selection))
        studies.append(SimpleNamespace(out=tmp_path / f"b{b}", base_seed=b, selected_keys=lambda: ["kd", "lbl"]))
    grid = SimpleNamespace(candidates={"kd": (0.1, 1.0, 10.0), "lbl": (0.001, 0.01, 0.1)},
                           pilot_choices=(("scale", 50.0, (100.0, 50.0), "base 0, seed 41"),))  # fmt: skip
    text = weights_table(grid, studies)
    assert "(mean of ID and OOD exact match; selection.json), and by the pilot before the grid" in text
    rows = [ln for ln in text.splitlines() if ln.startswith("| base") or ln.startswith("| pilot")]
    assert rows == [
        "| base 0 | kd | 10 | 0.1, 1, 10 | **top**: nothing beyond was tried |",
        "| base 0 | lbl | 0.01 | 0.001, 0.01, 0.1 |  |",
        "| base 1 | kd | 1 | 0.1, 1, 10 |  |",
        "| base 1 | lbl | 0.001 | 0.001, 0.01, 0.1 | **bottom**: nothing beyond was tried |",
        "| pilot (base 0, seed 41) | scale | 50 | 50, 100 | **bottom**: nothing beyond was tried |",
    ]
    assert "3 of 5 choices at an end of their candidates." in text
    assert weights_table(SimpleNamespace(candidates={}, pilot_choices=()), []) == ""  # all fixed, no pilot
