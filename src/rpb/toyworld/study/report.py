"""A study's report: its tables (rpb.toyworld.study.tables), chosen anchor weights, the base's scores and routing, and
its figures, written as tables.md beside results.json, from the cells' results alone."""

from __future__ import annotations

from pathlib import Path

from rpb.fileio import write_json_atomic, write_text_atomic
from rpb.toyworld.study.inputs import StudyInputs


def write_report(study: StudyInputs, results: list[dict], weights: dict[str, float]) -> str:
    """tables.md (tables, the anchor ``weights`` chosen, base scores, figures) and results.json of ``study``;
    returns the tables."""
    from rpb.toyworld.study.tables import machine_mix, paired_table, plot_retention, plot_tradeoff, table

    g = study.grid
    arms = tuple(a.label for a in g.arms)
    base_scores = {s: study.base_score(s) for s in g.sets}
    tables = "\n".join(table(kind, results, g.sets, arms, base_scores, g.table_kinds) for kind in g.tables)
    if study.trace_set:  # do static and transition retention tell one story? does a shuffle stay near rpb?
        tables += (
            "\n"
            + paired_table(results, study.trace_set)
            + (
                f"\nOne base, {len(g.seeds)} seeds: the bootstrap resamples the seeds only, and with so few its "
                "interval is narrower than a t interval would be.\n"
            )
        )
    plot_tradeoff(results, g.sets, arms, study.out / "tradeoff.png")
    plot_retention(results, g.sets, arms, study.out / "retention.png")
    base = {d: round(100 * v, 1) for d, v in study.base_record["heldout_exact_match"].items()}
    structure = study.base_routing()["mean"]
    lines = [
        f"# Toy-world study: grid `{g.name}`",
        "",
        f"{len(g.sets)} post-training set(s) x {len(g.arms)} arm(s) x {len(g.seeds)} seed(s) "
        f"{list(g.seeds)}; {study.post.max_steps} steps of batch {study.post.batch_size} on "
        f"{study.post.train_rows} rows; ID = the set's held-out test questions ({study.post.eval_id}), OOD = mean "
        f"over the pretraining domains' held-out test questions ({study.post.eval_ood} per domain at most); "
        "retention on the probe set against the base.",
        "",
        tables,
        machine_mix(results),
        "",
        "Anchor weights: "
        + (", ".join(f"{m} {w:g}" for m, w in sorted(weights.items())) or "none")
        + (" (fixed)" if g.coefficients is not None else " (chosen on the validation split: selection.json)"),
        *(
            [
                "Calibrated beta (`rpb calibrate`'s rule, rpb/calibrate/rule.py): "
                + ", ".join(f"{s} {study.calibrated_beta(s):g}" for s in g.sets)
                + " (calibration/<set>/calibrate.md)"
            ]
            if any(a.calibrated for a in g.arms)
            else []
        ),
        "",
        f"Base model held-out exact match % (pretraining's own evaluation): {base}",
        "",
        f"Base routing on the probe set (mean over MoE layers): utilization entropy "
        f"{structure['entropy_base_bits']:.3f} bits, {structure['communities_base']:.1f} Louvain communities, "
        f"modularity {structure['modularity_base']:.3f} (base_routing/report.md)",
        "",
        "![ID vs OOD](tradeoff.png)",
        "",
        "![retention](retention.png)",
        "",
    ]
    text = "\n".join(lines)
    write_text_atomic(study.out / "tables.md", text)
    write_json_atomic(study.out / "results.json", sorted(results, key=lambda r: (r["set"], r["arm"], r["seed"])))
    return tables


def write_across(out: Path, tables: str, results: list[dict], studies: list, cell=None) -> None:
    """A report across bases' files beside its figures: tables.md, results.json (the cells by base, set, arm and
    seed; ``cell(result)``: what of each the file keeps, all of it without one) and bases.json (each base's facts)."""
    out = Path(out)
    write_text_atomic(out / "tables.md", tables)
    ordered = sorted(results, key=lambda r: (r.get("base", 0), r["set"], r["arm"], r["seed"]))
    write_json_atomic(out / "results.json", [cell(r) for r in ordered] if cell else ordered)
    write_json_atomic(out / "bases.json", {st.base_seed: st.base_facts() for st in studies})
