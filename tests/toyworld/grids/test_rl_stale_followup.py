"""The follow-up's report from its runs' files: each scale's figures, PR2 minus R2 on the same run by hand, and the
sentence the figures allow."""

from __future__ import annotations

import json

from rpb.toyworld.grids.rl_stale_followup import SCALES, write_report


def _runs(tmp_path, stale, stale_r2):
    for scale, s, r in zip(SCALES, stale, stale_r2, strict=True):
        summary = {"stale_mismatch": s, "stale_mismatch_r2": r, "pr2_changed_share": s / 10}
        (tmp_path / f"pr2-{scale:g}.json").write_text(json.dumps({"summary": summary, "settings": {}, "scale": scale}))


def test_the_report_is_each_runs_figures_and_pr2_minus_r2_by_hand(tmp_path):
    _runs(tmp_path, stale=(0.05, 0.04, 0.06, 0.08), stale_r2=(0.03, 0.05, 0.03, 0.03))
    text = write_report(tmp_path)
    assert text == (tmp_path / "followup.md").read_text()
    rows = [ln for ln in text.splitlines() if ln.startswith("| ") and ln[2].isdigit()]
    assert rows[0] == "| 5 | 0.0500 | 0.0300 | 0.0050 | +0.0200 |"
    assert rows[1] == "| 10 | 0.0400 | 0.0500 | 0.0040 | -0.0100 |"
    assert [r.split(" | ")[0] for r in rows] == ["| 5", "| 10", "| 20", "| 50"]
    assert "Least stale against R2's routes on the same run: scale 10 (-0.0100)" in text
    assert "At some scale PR2's replayed routes are less stale than R2's would have been." in text


def test_staler_at_every_scale_is_said_so(tmp_path):
    _runs(tmp_path, stale=(0.05, 0.06, 0.07, 0.08), stale_r2=(0.01, 0.02, 0.03, 0.04))
    assert "staler than R2's would have been at every scale tried" in write_report(tmp_path)
