"""The paper's claims as the reference material states them, judged by rule on a grid's cells.

Each claim is computed from the cells it needs; a claim whose methods the grid did not run is
"not run". The mechanism figures (TVD, overlap with the base, displacement) are this project's own
evidence and no paper verdict rests on them. The rules are ``rpb.toyworld.study.stats``'s.
"""

from __future__ import annotations

import math

from rpb.toyworld.study.stats import Verdict, equivalent, extreme, greater, holm, paired_differences, well_below

METRICS = {"id": "ID", "ood": "OOD"}
FORMS = ("router-l2", "kl-to-base", "logit-l2")


def _not_run(claim: str, note: str = "") -> Verdict:
    return Verdict(claim, math.nan, (math.nan, math.nan), math.nan, "not run", note)


def judge(results: list[dict], sets: tuple[str, ...]) -> list[Verdict]:
    """Every claim on every post-training set, with Holm-adjusted verdicts across all of them."""
    arms = {r["arm"] for r in results}
    verdicts: list[Verdict] = []

    def diffs(post_set, arm, reference, metric):
        return paired_differences(results, post_set, arm, reference, metric) if {arm, reference} <= arms else {}

    for s in sets:
        for metric, name in METRICS.items():
            d = diffs(s, "rpb", "sft", metric)
            claim = f"RPB > SFT ({s}, {name})"
            note = "the paper calls this advantage model-dependent"
            verdicts.append(greater(claim, d, +1, note) if d else _not_run(claim, note))
            d = diffs(s, "lbl", "rpb", metric)
            claim = f"LBL below soft anchoring: LBL < RPB ({s}, {name})"
            verdicts.append(greater(claim, d, -1) if d else _not_run(claim))
            for form in FORMS:
                d = diffs(s, form, "rpb", metric)
                claim = f"anchoring forms comparable: {form} ≈ RPB ({s}, {name})"
                verdicts.append(equivalent(claim, d) if d else _not_run(claim))
            d = diffs(s, "within-soft", "rpb", metric)
            claim = f"within-soft ≈ RPB ({s}, {name})"
            verdicts.append(equivalent(claim, d) if d else _not_run(claim))
            d = diffs(s, "within-hard", "rpb", metric)
            claim = f"within-hard well below RPB ({s}, {name})"
            verdicts.append(well_below(claim, d) if d else _not_run(claim))
        others = sorted(arms - {"global-hard"})
        claim = f"global-hard lowest in accuracy ({s}, ID)"
        pairwise = {o: diffs(s, "global-hard", o, "id") for o in others} if "global-hard" in arms else {}
        verdicts.append(extreme(claim, pairwise, -1) if pairwise else _not_run(claim))
        claim = f"global-hard highest in NMI ({s})"
        pairwise = {o: diffs(s, "global-hard", o, "nmi") for o in others} if "global-hard" in arms else {}
        verdicts.append(extreme(claim, pairwise, +1) if pairwise else _not_run(claim))
        for reference in ("sft", "lbl"):
            d = diffs(s, "rpb", reference, "nmi")
            claim = f"soft anchoring's footprint: NMI of RPB > {reference.upper()} ({s})"
            verdicts.append(greater(claim, d, +1) if d else _not_run(claim))
    return holm(verdicts)


def verdict_table(verdicts: list[Verdict], claim: str = "claim (the paper's)") -> str:
    """The verdicts as a markdown table; ``claim``: the first column's heading."""
    lines = [
        f"| {claim} | estimate | 95% CI | p | verdict | Holm-adjusted | p, t over base means | note |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for v in verdicts:
        if v.verdict == "not run":
            lines.append(f"| {v.claim} | — | — | — | not run | not run | — | {v.note} |")
            continue
        lines.append(
            f"| {v.claim} | {v.estimate:+.3g} | [{v.ci[0]:+.3g}, {v.ci[1]:+.3g}] | {v.p:.3f} | {v.verdict} | "
            f"{v.holm} | {'—' if math.isnan(v.p_t) else f'{v.p_t:.3f}'} | {v.note} |"
        )
    return "\n".join(lines) + "\n"
