"""Paper-style tables and figures from the cells' result files (and nothing else).

Accuracies are exact match in percent; ``mean ± std`` is over seeds (sample standard deviation;
a single seed prints its value alone). Retention metrics are means over MoE layers of the
trained model against the base, on the probe set.
"""

from __future__ import annotations

import json
import math
import statistics
from collections import defaultdict
from pathlib import Path

from rpb.anchors import get_method
from rpb.toyworld.study.stats import equivalent, interval, paired_differences, two_stage_bootstrap

#: rpb.toyworld.world.post.mechanism's figures: the bias's displacement on the base before training, the fraction it
#: changed during training, and after training the overlap with the base's own sets and with the prior's top-k
MECHANISM_KEYS = ("start_displacement", "bias_changed", "overlap_base", "overlap_prior")

#: the long-trace table: exact match of the final line and of every line, static and transition retention
COT_COLUMNS = (
    "id",
    "id_lines",
    "ood",
    "tvd",
    "nmi",
    "transition_tvd",
    "transition_row_jsd",
    "transition_nmi",
    "step_transition_nmi",
)
#: the table kinds every grid can ask for: title, columns, and whether its rows are every arm of the grid
#: (in grid order) or only the arms whose method the methods table lists in this kind of table
#: (``Method.tables``), in grid order too; a grid adds kinds of its own (``Grid.table_kinds``)
TABLES: dict[str, tuple[str, tuple[str, ...], bool]] = {
    "main": ("Main results", ("id", "ood"), True),
    "forms": ("Anchoring forms", ("id", "ood", "tvd", "topk_overlap"), False),
    "controls": ("Interventional controls", ("id", "ood", "nmi"), False),
    "mechanism": ("Mechanism: what the training did to the base's routing (content tokens)", MECHANISM_KEYS, True),
}
#: exact-match figures, shown in percent (``id_lines``: a trace's lines, ``rpb.toyworld.world.tasks.line_accuracy``)
PERCENT = ("id", "id_lines", "ood")
HEADERS = {
    "id": "ID %",
    "id_lines": "ID lines %",
    "ood": "OOD %",
    "tvd": "TVD",
    "topk_overlap": "top-k overlap",
    "nmi": "NMI",
    "transition_tvd": "transition TVD",
    "transition_row_jsd": "transition row JSD",
    "transition_nmi": "transition NMI",
    "step_transition_nmi": "step NMI",
    "start_displacement": "displaced before training",
    "bias_changed": "changed during training",
    "overlap_base": "overlap with base sets",
    "overlap_prior": "overlap with prior top-k",
}


def mean_sd(values: list[float], digits: int = 1, empty: str = "n/a") -> str:
    """Mean ± sample sd of ``values`` (the value alone for one; ``empty`` for none)."""
    if not values:
        return empty
    if len(values) == 1:
        return f"{values[0]:.{digits}f}"
    return f"{statistics.fmean(values):.{digits}f} ± {statistics.stdev(values):.{digits}f}"


def bases_table(studies: list) -> str:
    """Each base: held-out exact match of its pretraining evaluation, routing structure on the probe set."""
    facts = [st.base_facts() for st in studies]
    domains = list(facts[0]["heldout_exact_match"])
    header = [
        "base",
        *(f"{d} %" for d in domains),
        "modularity",
        "communities",
        "between-domain JSD (bits)",
        "weights sha256",
    ]
    lines = ["### The bases", "", "| " + " | ".join(header) + " |", "|---" * len(header) + "|"]
    for f in facts:
        em = [f"{100 * f['heldout_exact_match'][d]:.1f}" for d in domains]
        structure = [f"{f['modularity']:.3f}", f"{f['communities']:.1f}", f"{f['between_domain_jsd_bits']:.3f}"]
        lines.append(f"| {f['seed']} | " + " | ".join([*em, *structure, f["weights_sha256"][:12]]) + " |")
    return "\n".join(lines) + "\n"


def machine_mix(results: list[dict]) -> str:
    """Which machine types, thread counts and torch builds the cells ran on: a grid may be continued on another
    machine only on the same pinned base, and its tables say so. Cells from before machines (or torch builds)
    were recorded count as such."""
    counts: dict[tuple[str, int | None, str], int] = defaultdict(int)
    unrecorded = ", torch not recorded" if any("torch" in r for r in results) else ""  # said only beside recorded
    for r in results:
        torch = f" with torch {r['torch']}" if "torch" in r else unrecorded
        counts[(r.get("machine") or "machine not recorded", r.get("threads"), torch)] += 1
    parts = [
        f"{n} on {m}" + (f" at {t} thread{'s' if t != 1 else ''}" if t else "") + v
        for (m, t, v), n in sorted(counts.items(), key=lambda kv: (-kv[1], str(kv[0])))
    ]
    return f"Cells ran on: {'; '.join(parts)}." if parts else "Cells ran on: no cells."


def value(result: dict, key: str) -> float:
    if key in PERCENT:
        return 100.0 * result[key] if key in result else math.nan
    if key in MECHANISM_KEYS:
        v = result.get("mechanism", {}).get(key)
        return math.nan if v is None else float(v)
    return float(result.get("retention", {}).get(key, math.nan))


def aggregate(results: list[dict]) -> dict[tuple[str, str], dict[str, list[float]]]:
    """(set, arm) -> metric -> values over seeds, in seed order."""
    out: dict[tuple[str, str], dict[str, list[float]]] = defaultdict(lambda: defaultdict(list))
    for r in sorted(results, key=lambda r: r["seed"]):
        for key in HEADERS:
            out[(r["set"], r["arm"])][key].append(value(r, key))
    return out


def fmt(values: list[float], key: str) -> str:
    digits = 1 if key in PERCENT else 3
    vals = [v for v in values if not math.isnan(v)]
    if not vals:
        return "n/a"
    mean = statistics.fmean(vals)
    if len(vals) == 1:
        return f"{mean:.{digits}f}"
    return f"{mean:.{digits}f} ± {statistics.stdev(vals):.{digits}f}"


def table(
    kind: str,
    results: list[dict],
    sets: tuple[str, ...],
    arms: tuple[str, ...],
    base: dict[str, dict] | None = None,
    kinds: dict | None = None,
) -> str:
    """One markdown table; ``base`` (set -> the base model's ``id`` / ``ood``) adds a reference first row;
    ``kinds``: the grid's own table kinds beside ``TABLES``."""
    title, cols, every_arm = ({**TABLES, **(kinds or {})})[kind]
    agg = aggregate(results)
    method = {r["arm"]: r["method"] for r in results}
    rows = tuple(a for a in arms if every_arm or (a in method and kind in get_method(method[a]).tables))
    head = ["method"] + [f"{s} {HEADERS[c]}" if len(sets) > 1 else HEADERS[c] for s in sets for c in cols]
    lines = [f"### {title}", "", "| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    if base:  # retention of the base against itself is trivial (TVD 0, overlap 1, NMI 1): not shown
        cells = [fmt([100.0 * base[s][c]], c) if c in PERCENT and c in base[s] else "—" for s in sets for c in cols]
        lines.append("| *base (before post-training)* | " + " | ".join(cells) + " |")
    for arm in rows:
        cells = [fmt(agg[(s, arm)][c], c) if (s, arm) in agg else "n/a" for s in sets for c in cols]
        lines.append(f"| {arm} | " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"


#: the long-trace grid's paired comparisons (arm, reference): each anchor against sft, each shuffled
#: control against rpb (the paper's within-soft ~ rpb, asked again on the transition axis), and the two
#: soft shuffles against each other
TRACE_PAIRS = (
    ("lbl", "sft"),
    ("rpb", "sft"),
    ("within-soft", "rpb"),
    ("within-hard", "rpb"),
    ("within-transition-soft", "rpb"),
    ("within-transition-hard", "rpb"),
    ("within-transition-soft", "within-soft"),
)
TRACE_PAIR_METRICS = ("id", "id_lines", "tvd", "nmi", "transition_tvd", "transition_nmi", "step_transition_nmi")


def paired_table(results: list[dict], post_set: str, pairs=TRACE_PAIRS, metrics=TRACE_PAIR_METRICS) -> str:
    """Each (arm, reference) pair's mean difference on the same (base, seed), with the two-stage bootstrap's
    95% interval, per metric; then whether the static and the transition NMI move the same way (each
    counted only where its interval excludes 0) and whether ID is equivalent within 2 points (two one-sided
    tests, the claims' rule)."""
    arms = {r["arm"] for r in results if r["set"] == post_set}
    head = ["arm − reference", *(HEADERS[m] for m in metrics), "static vs transition NMI", "ID ≈ (±2 points)"]
    lines = [
        f"### {post_set}: paired differences on the same base and seed [95% CI]",
        "",
        "| " + " | ".join(head) + " |",
        "|" + "---|" * len(head),
    ]
    way = {1: "up", -1: "down"}
    for arm, reference in pairs:
        if not {arm, reference} <= arms:
            continue
        diffs = {
            m: paired_differences(results, post_set, arm, reference, m)
            for m in (*metrics, "id", "nmi", "transition_nmi")
        }
        flat = {m: [v for vs in d.values() for v in vs] for m, d in diffs.items()}
        if len(flat["id"]) < 2:  # one pair has no spread to resample: its interval would be a point
            word = "one pair" if flat["id"] else "no pairs"
            cells = [f"{flat[m][0]:+.{1 if m in PERCENT else 3}f} (one pair)" if flat[m] else "—" for m in metrics]
            lines.append(f"| {arm} − {reference} | " + " | ".join([*cells, word, word]) + " |")
            continue
        ci = {m: interval(two_stage_bootstrap(d)) for m, d in diffs.items()}  # once per metric
        cells = []
        for m in metrics:
            digits = 1 if m in PERCENT else 3
            lo, hi = ci[m]
            cells.append(f"{statistics.fmean(flat[m]):+.{digits}f} [{lo:+.{digits}f}, {hi:+.{digits}f}]")
        # +1 / -1 where the 95% interval excludes 0 above / below, else 0
        static, moving = ((lo > 0) - (hi < 0) for lo, hi in (ci["nmi"], ci["transition_nmi"]))
        if static and moving:
            story = f"{'same' if static == moving else 'opposite'} (static {way[static]}, transition {way[moving]})"
        elif static or moving:
            story = f"only static ({way[static]})" if static else f"only transition ({way[moving]})"
        else:
            story = "neither"
        same = {"reproduces": "yes", "contradicted": "no", "inconclusive": "inconclusive"}[
            equivalent("", diffs["id"]).verdict
        ]
        lines.append(f"| {arm} − {reference} | " + " | ".join([*cells, story, same]) + " |")
    return "\n".join(lines) + "\n"


def plot_tradeoff(results: list[dict], sets: tuple[str, ...], arms: tuple[str, ...], path: Path) -> Path:
    """ID against OOD accuracy per arm (mean, with the seeds' standard deviation as error bars)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    agg = aggregate(results)
    fig, axes = plt.subplots(1, len(sets), figsize=(5.5 * len(sets), 4.5), squeeze=False)
    for ax, s in zip(axes[0], sets, strict=True):
        for arm in arms:
            if (s, arm) not in agg:
                continue
            ids, oods = agg[(s, arm)]["id"], agg[(s, arm)]["ood"]
            sd = lambda v: statistics.stdev(v) if len(v) > 1 else 0.0  # noqa: E731
            ax.errorbar(statistics.fmean(ids), statistics.fmean(oods), xerr=sd(ids), yerr=sd(oods), fmt="o", capsize=3)
            ax.annotate(
                arm,
                (statistics.fmean(ids), statistics.fmean(oods)),
                textcoords="offset points",
                xytext=(4, 4),
                fontsize=8,
            )
        ax.set_xlabel(f"ID exact match % ({s})")
        ax.set_ylabel("OOD exact match % (mean of base domains)")
        ax.set_title(s)
        ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path


def plot_retention(results: list[dict], sets: tuple[str, ...], arms: tuple[str, ...], path: Path) -> Path:
    """TVD, top-k overlap and NMI per arm (means over seeds)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    agg = aggregate(results)
    keys = ("tvd", "topk_overlap", "nmi")
    fig, axes = plt.subplots(
        len(sets), len(keys), figsize=(4.2 * len(keys), 0.35 * len(arms) + 2.2 * len(sets)), squeeze=False
    )
    for row, s in zip(axes, sets, strict=True):
        present = [a for a in arms if (s, a) in agg]
        for ax, key in zip(row, keys, strict=True):
            means = [statistics.fmean(agg[(s, a)][key]) if agg[(s, a)][key] else math.nan for a in present]
            ax.barh(range(len(present)), means, color="tab:blue")
            ax.set_yticks(range(len(present)), present, fontsize=8)
            ax.invert_yaxis()
            ax.set_xlim(0, 1)
            ax.set_title(f"{s}: {HEADERS[key]}", fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path


#: the mechanism table's columns: what the bias did to the routing (``world.mechanism``)
MECHANISM = {
    "start_displacement": "displaced before training",
    "bias_changed": "changed during training",
    "overlap_base": "overlap with base sets",
    "overlap_prior": "overlap with prior top-k",
}


def mechanism_table(results: list[dict], post_set: str, arms: tuple[str, ...]) -> str:
    lines = [
        f"### {post_set}: what the training did to the routing (content tokens, mean ± sd over cells)",
        "",
        "| method | " + " | ".join(MECHANISM.values()) + " |",
        "|---" * (len(MECHANISM) + 1) + "|",
    ]
    for arm in arms:
        cells = [r["mechanism"] for r in results if r["set"] == post_set and r["arm"] == arm and "mechanism" in r]
        if cells:
            values = [mean_sd([c[k] for c in cells if c.get(k) is not None], 3) for k in MECHANISM]
            lines.append(f"| {arm} | " + " | ".join(values) + " |")
    return "\n".join(lines) + "\n"


def edge_of(chosen: float, candidates) -> str:
    """Where a choice sits among its candidates: "bottom" or "top" at either end (the range may cap it: nothing
    beyond was tried), "" inside."""
    ordered = sorted(candidates)
    if len(ordered) < 2:
        return ""
    return "bottom" if chosen == ordered[0] else "top" if chosen == ordered[-1] else ""


def weights_table(grid, studies: list) -> str:
    """Each base's anchor weights chosen on the validation part (its selection.json), each with its candidates, and
    a choice at either end of them flagged; then any setting a pilot chose before the grid. Empty where the grid
    fixes every weight and ran no pilot."""
    rows, criteria = [], set()
    for st in studies:
        where = Path(st.out) / "selection.json"
        selection = json.loads(where.read_text()) if where.is_file() else {}
        criteria.add(selection.get("criterion"))
        for key in st.selected_keys():
            if key in selection.get("chosen", {}):
                rows.append((f"base {st.base_seed}", key, selection["chosen"][key], grid.candidates[key]))
    pilot = [(f"pilot ({ran})", name, value, candidates) for name, value, candidates, ran in grid.pilot_choices]
    if not rows + pilot:
        return ""
    how = " or ".join(sorted(c for c in criteria if c)) or "the grid's criterion"
    lines = [
        f"### Weights chosen per base on the validation part ({how}; selection.json)"
        + (", and by the pilot before the grid" if pilot else "")
        + ", with their candidates",
        "",
        "| where | setting | chosen | candidates | at an end of its candidates |",
        "|---|---|---|---|---|",
    ]
    for where, key, value, candidates in rows + pilot:
        edge = edge_of(value, candidates)
        flag = f"**{edge}**: nothing beyond was tried" if edge else ""
        lines.append(f"| {where} | {key} | {value:g} | {', '.join(f'{c:g}' for c in sorted(candidates))} | {flag} |")
    at_edge = sum(bool(edge_of(v, c)) for _, _, v, c in rows + pilot)
    lines += ["", f"{at_edge} of {len(rows + pilot)} choices at an end of their candidates.", ""]
    return "\n".join(lines)
