"""The revert report's interval and pages: the interval is a percentile bootstrap of the paired mean over rows
(checked against a hand-drawn one and against the normal approximation), report.md holds every set's row and the
figure is drawn."""

from __future__ import annotations

import numpy as np
import pytest

from rpb.retention.revert_report import delta_interval, markdown, write_revert


def test_the_interval_is_a_bootstrap_of_the_paired_mean_over_rows():
    rng = np.random.default_rng(1)
    before = rng.normal(2.0, 0.5, 400)
    after = before + rng.normal(0.1, 0.3, 400)
    got = delta_interval(list(after), list(before), resamples=4000, seed=3)
    d = after - before
    assert got["estimate"] == pytest.approx(d.mean()) and got["rows"] == 400
    hand = np.quantile([rng.choice(d, len(d)).mean() for _ in range(4000)], [0.025, 0.975])
    assert got["ci"] == pytest.approx(list(hand), abs=0.004)
    half = 1.96 * d.std(ddof=1) / np.sqrt(len(d))
    assert got["ci"] == pytest.approx([d.mean() - half, d.mean() + half], abs=0.004)
    same = delta_interval([1.0, 2.0, 3.0], [0.5, 1.5, 2.5])
    assert same["estimate"] == pytest.approx(0.5) and same["ci"] == pytest.approx([0.5, 0.5])


def _report(reverse: bool, generate: bool) -> dict:
    names = ["post", "post+base routers", "base"] + (["base+post routers"] if reverse else [])
    figure = {"nll": 1.0, "nll_rows": [1.0], "topk_overlap": {"all": 0.5, "Q": 0.4, "A": 0.6}, "exact_match": 0.25}
    entry = {
        "rows": 3,
        "variants": dict.fromkeys(names, figure),
        "delta_nll": {"estimate": 0.125, "ci": [0.0625, 0.25], "rows": 3},
        **({"max_new_tokens": 7} if generate else {}),
        **({"delta_nll_reverse": {"estimate": -0.5, "ci": [-1.0, -0.25], "rows": 3}} if reverse else {}),
    }
    return {"base": "b", "post": "p", "training_domain": "math", "variants": names, "shared_gates": False,
            "generate": generate, "sets": {"math": entry, "code": entry}}  # fmt: skip


def test_the_page_holds_every_set_and_says_which_is_trained(tmp_path):
    md = markdown(_report(True, True), "revert.png")
    assert "| math (trained) | 3 |" in md and "| code | 3 |" in md and "+0.1250 [+0.0625, +0.2500]" in md
    assert "| math | 7 | 0.250 | 0.250 | 0.250 | 0.250 |" in md and "- code: -0.5000 [-1.0000, -0.2500]" in md
    plain = markdown(_report(False, False), None)
    assert "Exact match" not in plain and "Reverse" not in plain and "shared-expert gates left alone" in plain
    write_revert(_report(False, False), tmp_path)
    assert (tmp_path / "revert.png").read_bytes()[:4] == b"\x89PNG" and (tmp_path / "report.md").is_file()


def test_small_differences_print_in_scientific_notation_never_as_minus_zero():
    from rpb.retention.revert_report import interval, signed

    assert signed(-1.2e-5) == "-1.20e-05" and signed(0.0) == "+0.0000" and signed(0.0512) == "+0.0512"
    assert interval({"estimate": -1.2e-5, "ci": [-3.4e-5, 8.0e-6]}) == "-1.20e-05 [-3.40e-05, +8.00e-06]"
    assert interval({"estimate": 0.05, "ci": [0.0347, 0.0662]}) == "+0.0500 [+0.0347, +0.0662]"
