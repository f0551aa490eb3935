"""Statistics across bases and seeds: paired differences, a two-stage bootstrap, detectable
differences, and verdicts computed by rule (pure: numbers in, numbers and words out).

A cell is (base, seed); a method's paired difference is its score minus the reference method's
(``sft``) on the same (base, seed), in points. The bootstrap resamples bases with replacement,
then seeds within each drawn base with replacement, and takes the mean of the drawn differences;
10,000 resamples, a fixed seed. Verdicts (the rules also stand in docs/toyworld.md):

* ``>``: *reproduces* if the 95% interval excludes 0 in the paper's direction and no base's own
  mean difference has the opposite sign; *contradicted* if it excludes 0 the other way; else
  *inconclusive*.
* ``≈`` (two one-sided tests, margin 2 points): *reproduces* if the 90% interval lies inside
  (-2, 2); *contradicted* if the 95% interval lies wholly outside [-2, 2]; else *inconclusive*.
* "well below": *reproduces* if the 95% interval's upper end is below -5; *contradicted* if its
  lower end is above -5; else *inconclusive*.
* "lowest" / "highest": *reproduces* if every pairwise interval excludes 0 in that direction;
  *contradicted* if any excludes 0 the other way; else *inconclusive*.

Each verdict carries a bootstrap p-value for its own null; ``holm`` adjusts them across claims, and
a claim Holm does not reject is reported inconclusive in the adjusted column.

With 3 bases the percentile bootstrap is narrow: it draws only 10 distinct multisets of bases, so
three bases whose means share a sign give p = 0.0002 however close to 0 they lie. Each verdict
therefore also carries ``p_t``, the same null tested by Student's t over the *base means* (n = bases,
n - 1 degrees of freedom; ``nan`` below 2 bases), the conservative reading for clustered data. The
verdict words stay the bootstrap's (the rule fixed before the data); ``p_t`` says which of them the
t reading would not carry.
"""

from __future__ import annotations

import math
from collections import defaultdict
from dataclasses import dataclass

import numpy as np
from scipy.stats import t as student_t
from scipy.stats import ttest_1samp

RESAMPLES = 10_000
BOOTSTRAP_SEED = 0
EQUIVALENCE_MARGIN = 2.0
WELL_BELOW = -5.0
ALPHA = 0.05
POWER = 0.8


def points(result: dict, metric: str) -> float:
    """A cell's figure: exact match in percent for ``id`` / ``ood`` (and a trace's ``id_lines``), else a
    retention metric."""
    if metric in ("id", "ood", "id_lines"):
        return 100.0 * result[metric]
    return float(result.get("retention", {}).get(metric, math.nan))


def paired_differences(results: list[dict], post_set: str, arm: str, reference: str, metric: str):
    """{base: [difference per seed, in seed order]} of ``arm`` minus ``reference`` on ``post_set``."""
    by = {(r["arm"], r.get("base", 0), r["seed"]): r for r in results if r["set"] == post_set}
    out: dict[int, list[float]] = defaultdict(list)
    for (a, base, seed), r in sorted(by.items(), key=lambda kv: (kv[0][1], kv[0][2])):
        if a == arm and (reference, base, seed) in by:
            out[base].append(points(r, metric) - points(by[(reference, base, seed)], metric))
    return dict(out)


def judge_paired(results: list[dict], rule, claim: str, arm: str, reference: str, post_set: str, metric: str, *args):
    """``rule(claim, paired differences, *args)`` of ``arm`` against ``reference`` on ``post_set``; ``not run`` where
    either arm has no cell or no pair."""
    if not {arm, reference} <= {r["arm"] for r in results}:
        return not_run(claim)
    d = paired_differences(results, post_set, arm, reference, metric)
    return rule(claim, d, *args) if d else not_run(claim)


def two_stage_bootstrap(diffs: dict[int, list[float]], resamples: int = RESAMPLES, seed: int = BOOTSTRAP_SEED):
    """Resampled means: bases with replacement, then seeds within each drawn base with replacement.

    The draws are numpy's, in this order: every resample's bases, then per resample and drawn base its seeds.
    Where every base has as many seeds (every shipped grid) they are drawn in one call: numpy's bounded integers
    take one 32-bit value of the generator's stream each, whatever the call's size, so the values and each mean's
    summation (numpy's, row by row) are the one-at-a-time loop's, bit for bit, hundreds of times sooner."""
    rng = np.random.default_rng(seed)
    per_base = [np.asarray(v, dtype=float) for _, v in sorted(diffs.items())]
    if not per_base:
        return np.array([])
    drawn_bases = rng.integers(len(per_base), size=(resamples, len(per_base)))
    seeds = {len(v) for v in per_base}
    if len(seeds) == 1:
        (n,) = seeds
        drawn_seeds = rng.integers(n, size=(resamples, len(per_base), n))
        picked = np.stack(per_base)[drawn_bases[:, :, None], drawn_seeds]
        return picked.reshape(resamples, -1).mean(axis=1)
    means = np.empty(resamples)
    for i, bases in enumerate(drawn_bases):
        values = [per_base[b][rng.integers(len(per_base[b]), size=len(per_base[b]))] for b in bases]
        means[i] = np.concatenate(values).mean()
    return means


def interval(boot: np.ndarray, level: float = 0.95) -> tuple[float, float]:
    tail = (1 - level) / 2
    return float(np.quantile(boot, tail)), float(np.quantile(boot, 1 - tail))


def minimal_detectable_difference(paired_sd: float, pairs: int, alpha: float = ALPHA, power: float = POWER) -> float:
    """The smallest true mean difference a paired t-test of ``pairs`` pairs detects at ``alpha`` (two-sided)
    with probability ``power``: (t_{1-alpha/2} + t_{power}) * sd / sqrt(n), t with n - 1 degrees of freedom."""
    if pairs < 2:
        return math.nan
    df = pairs - 1
    return float((student_t.ppf(1 - alpha / 2, df) + student_t.ppf(power, df)) * paired_sd / math.sqrt(pairs))


def _base_means(diffs: dict[int, list[float]]) -> np.ndarray:
    return np.array([np.mean(v) for _, v in sorted(diffs.items())], dtype=float)


def t_p(diffs: dict[int, list[float]], null: float = 0.0, alternative: str = "two-sided") -> float:
    """p of Student's t over the base means against ``null`` (``alternative`` as scipy's: "two-sided",
    "greater": the mean is above ``null``, "less"); ``nan`` with fewer than 2 bases or no spread."""
    means = _base_means(diffs)
    # no spread up to float rounding (0.4 - 0.3 differs from 0.5 - 0.4 in the last bit): no t
    if len(means) < 2 or np.ptp(means) <= 1e-9 * max(1.0, float(np.abs(means).max())):
        return math.nan
    return float(ttest_1samp(means, null, alternative=alternative).pvalue)


def _p_at_least(boot: np.ndarray, value: float) -> float:
    """P(mean >= value) under the bootstrap, with the +1 correction that keeps it above 0."""
    return float((np.sum(boot >= value) + 1) / (len(boot) + 1))


def _p_at_most(boot: np.ndarray, value: float) -> float:
    return float((np.sum(boot <= value) + 1) / (len(boot) + 1))


@dataclass
class Verdict:
    claim: str
    estimate: float
    ci: tuple[float, float]
    p: float
    verdict: str
    note: str = ""
    holm: str = ""
    #: the same null by Student's t over the base means (``t_p``)
    p_t: float = math.nan


def not_run(claim: str) -> Verdict:
    """The verdict of a claim whose arms the grid did not run (no estimate, no p)."""
    return Verdict(claim, math.nan, (math.nan, math.nan), math.nan, "not run")


def greater(claim: str, diffs: dict[int, list[float]], direction: int = 1, note: str = "") -> Verdict:
    """A ``>`` claim on ``mean(diffs)``, in the paper's ``direction`` (+1: above 0, -1: below)."""
    boot = two_stage_bootstrap(diffs)
    est = float(np.mean([v for vs in diffs.values() for v in vs]))
    lo, hi = interval(boot)
    against = any(direction * np.mean(v) < 0 for v in diffs.values())
    if (lo > 0 if direction > 0 else hi < 0) and not against:
        word = "reproduces"
    elif hi < 0 if direction > 0 else lo > 0:
        word = "contradicted"
    else:
        word = "inconclusive"
    p = min(1.0, 2 * min(_p_at_most(boot, 0.0), _p_at_least(boot, 0.0)))
    return Verdict(claim, est, (lo, hi), p, word, note, p_t=t_p(diffs))


def equivalent(
    claim: str, diffs: dict[int, list[float]], margin: float = EQUIVALENCE_MARGIN, note: str = ""
) -> Verdict:
    """An ``≈`` claim by two one-sided tests against +/- ``margin``."""
    boot = two_stage_bootstrap(diffs)
    est = float(np.mean([v for vs in diffs.values() for v in vs]))
    lo90, hi90 = interval(boot, 0.90)
    lo, hi = interval(boot)
    if -margin < lo90 and hi90 < margin:
        word = "reproduces"
    elif lo > margin or hi < -margin:
        word = "contradicted"
    else:
        word = "inconclusive"
    p = max(_p_at_most(boot, -margin), _p_at_least(boot, margin))
    p_t = max(t_p(diffs, -margin, "greater"), t_p(diffs, margin, "less"))
    return Verdict(claim, est, (lo, hi), p, word, note, p_t=p_t)


def well_below(claim: str, diffs: dict[int, list[float]], threshold: float = WELL_BELOW, note: str = "") -> Verdict:
    boot = two_stage_bootstrap(diffs)
    est = float(np.mean([v for vs in diffs.values() for v in vs]))
    lo, hi = interval(boot)
    word = "reproduces" if hi < threshold else "contradicted" if lo > threshold else "inconclusive"
    return Verdict(claim, est, (lo, hi), _p_at_least(boot, threshold), word, note, p_t=t_p(diffs, threshold, "less"))


def extreme(claim: str, pairwise: dict[str, dict[int, list[float]]], direction: int, note: str = "") -> Verdict:
    """ "Lowest" (``direction`` -1) or "highest" (+1): every difference to another method, this minus it."""
    verdicts = [greater(other, diffs, direction) for other, diffs in pairwise.items()]
    if not verdicts:
        return Verdict(claim, math.nan, (math.nan, math.nan), math.nan, "not run", note)
    excluded = [(v.ci[0] > 0) if direction > 0 else (v.ci[1] < 0) for v in verdicts]
    wrong = [(v.ci[1] < 0) if direction > 0 else (v.ci[0] > 0) for v in verdicts]
    word = "reproduces" if all(excluded) else "contradicted" if any(wrong) else "inconclusive"
    worst = min(verdicts, key=lambda v: direction * v.estimate)
    p_ts = [v.p_t for v in verdicts]
    p, p_t = max(v.p for v in verdicts), math.nan if any(map(math.isnan, p_ts)) else max(p_ts)
    return Verdict(claim, worst.estimate, worst.ci, p, word, note + f" (closest: {worst.claim})", p_t=p_t)


#: the note of a claim a grid reports either way, outside its Holm family
OUTSIDE_NOTE = "reported either way, outside the Holm family"


def holm(verdicts: list[Verdict], alpha: float = ALPHA) -> list[Verdict]:
    """Holm's step-down over the claims' p-values: each keeps its verdict only if Holm rejects its null."""
    ranked = sorted((v for v in verdicts if not math.isnan(v.p)), key=lambda v: v.p)
    still = True
    for i, v in enumerate(ranked):
        still = still and v.p <= alpha / (len(ranked) - i)
        v.holm = v.verdict if still or v.verdict == "inconclusive" else "inconclusive"
    for v in verdicts:
        v.holm = v.holm or v.verdict
    return verdicts


def holm_beside(family: list[Verdict], outside: list[Verdict]) -> list[Verdict]:
    """Holm across ``family``; then ``outside``, unadjusted, each noted as reported either way outside the family."""
    holm(family)
    for v in outside:
        v.note = OUTSIDE_NOTE
        v.holm = "outside Holm" if v.verdict != "not run" else "not run"
    return family + outside


def cost_under(claim: str, diffs: dict[int, list[float]], cost: float, note: str = "") -> Verdict:
    """ "At a cost under ``cost`` points": *reproduces* if the 95% interval's lower end is above ``-cost``,
    *contradicted* if its upper end is below ``-cost``, else *inconclusive*."""
    boot = two_stage_bootstrap(diffs)
    est = float(np.mean([v for vs in diffs.values() for v in vs]))
    lo, hi = interval(boot)
    word = "reproduces" if lo > -cost else "contradicted" if hi < -cost else "inconclusive"
    p = float((np.sum(boot <= -cost) + 1) / (len(boot) + 1))
    return Verdict(claim, est, (lo, hi), p, word, note, p_t=t_p(diffs, -cost, "greater"))


def threshold_above(claim: str, diffs: dict[int, list[float]], threshold: float, note: str = "") -> Verdict:
    """ "Above ``threshold``": *reproduces* if the 95% interval's lower end is above it, *contradicted* if its
    upper end is below it, else *inconclusive*; p is two-sided against the threshold, as ``greater``'s against 0, so
    Holm keeps a clear verdict either way."""
    boot = two_stage_bootstrap(diffs)
    est = float(np.mean([v for vs in diffs.values() for v in vs]))
    lo, hi = interval(boot)
    word = "reproduces" if lo > threshold else "contradicted" if hi < threshold else "inconclusive"
    p = min(1.0, 2 * min(_p_at_most(boot, threshold), _p_at_least(boot, threshold)))
    return Verdict(claim, est, (lo, hi), p, word, note, p_t=t_p(diffs, threshold))


def relative_differences(results: list[dict], post_set: str, arm: str, reference: str, metric: str):
    """{base: [100 x (arm - reference) / reference per seed]}: a difference in percent of the reference's value."""
    by = {(r["arm"], r.get("base", 0), r["seed"]): points(r, metric) for r in results if r["set"] == post_set}
    out: dict[int, list[float]] = {}
    for (a, base, seed), value in sorted(by.items(), key=lambda kv: (kv[0][1], kv[0][2])):
        ref = by.get((reference, base, seed))
        if a == arm and ref:
            out.setdefault(base, []).append(100.0 * (value - ref) / ref)
    return out
