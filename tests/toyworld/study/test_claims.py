"""The paper's claims judged on synthetic cells: the right pairs, not-run claims, the table."""

from __future__ import annotations

from rpb.toyworld.study.claims import judge, verdict_table


def cell(arm, base, seed, id_, ood, nmi):
    return {"set": "s", "arm": arm, "base": base, "seed": seed, "id": id_, "ood": ood, "retention": {"nmi": nmi}}


def test_claims_on_a_headline_like_grid():
    results = []
    for base in (0, 1, 2):
        for seed in (42, 43, 44):
            jitter = 0.001 * (base + seed % 3)
            results += [
                cell("sft", base, seed, 0.40 + jitter, 0.30, 0.30),
                cell("lbl", base, seed, 0.30 + jitter, 0.25, 0.31),
                cell("rpb", base, seed, 0.50 + jitter, 0.30 + jitter, 0.40),
            ]
    verdicts = {v.claim: v for v in judge(results, ("s",))}
    assert verdicts["RPB > SFT (s, ID)"].verdict == "reproduces"
    assert abs(verdicts["RPB > SFT (s, ID)"].estimate - 10.0) < 1e-9
    assert verdicts["RPB > SFT (s, OOD)"].verdict in ("reproduces", "inconclusive")
    assert verdicts["LBL below soft anchoring: LBL < RPB (s, ID)"].verdict == "reproduces"
    assert verdicts["soft anchoring's footprint: NMI of RPB > SFT (s)"].verdict == "reproduces"
    assert verdicts["within-soft ≈ RPB (s, ID)"].verdict == "not run"
    assert verdicts["global-hard lowest in accuracy (s, ID)"].verdict == "not run"
    table = verdict_table(list(verdicts.values()))
    assert "| RPB > SFT (s, ID) | +10 |" in table and "not run" in table
    assert "the paper calls this advantage model-dependent" in table
    # the t cross-check over base means: every base's ID difference is 10 points exactly, so no t
    assert "| p, t over base means |" in table
    row = next(line for line in table.splitlines() if line.startswith("| RPB > SFT (s, ID) |"))
    assert row.split(" | ")[6] == "—"
    ood = verdicts["RPB > SFT (s, OOD)"]  # base means 0.1, 0.2, 0.3 points: t = 0.2 / (0.1 / sqrt 3)
    t = 0.2 / (0.1 / 3**0.5)
    assert abs(ood.p_t - (1 - t / (2 + t * t) ** 0.5)) < 1e-9
