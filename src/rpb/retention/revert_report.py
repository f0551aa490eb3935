"""The revert test's report: the bootstrap interval of a change in NLL over rows, report.json, report.md and the
figure (revert.png: the change in answer NLL from reverting, per domain, with its interval)."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
from scipy.stats import bootstrap

from rpb.fileio import write_text_atomic

#: the interval's level
LEVEL = 0.95


def signed(x: float) -> str:
    """A signed figure: four decimals, or scientific notation where four decimals would read 0 (a ΔNLL of 1e-5
    is not -0.0000)."""
    return f"{x:+.4f}" if x == 0 or abs(x) >= 5e-5 else f"{x:+.2e}"


def interval(d: dict) -> str:
    """``estimate [low, high]``, each ``signed``."""
    return f"{signed(d['estimate'])} [{signed(d['ci'][0])}, {signed(d['ci'][1])}]"


def delta_interval(after: list[float], before: list[float], resamples: int = 2000, seed: int = 0) -> dict:
    """The mean over rows of ``after - before`` (paired: the same rows) and its percentile bootstrap interval over
    rows (scipy's, ``resamples`` draws seeded by ``seed``)."""
    d = np.asarray(after, dtype=np.float64) - np.asarray(before, dtype=np.float64)
    if len(d) < 2:
        return {"estimate": float(d.mean()), "ci": [float("nan")] * 2, "rows": len(d)}
    res = bootstrap(
        (d,),
        np.mean,
        n_resamples=resamples,
        confidence_level=LEVEL,
        method="percentile",
        rng=np.random.default_rng(seed),
    )
    lo, hi = res.confidence_interval
    return {"estimate": float(d.mean()), "ci": [float(lo), float(hi)], "rows": len(d)}


def _domains(report: dict) -> list[str]:
    return [n for n, e in report["sets"].items() if "delta_nll" in e and n != "routing data"]


def markdown(report: dict, image: str | None) -> str:
    names = report["variants"]
    lines = [
        "# Routers reverted: does the routing drift matter?",
        "",
        f"- base: `{report['base']}`",
        f"- post: `{report['post']}`",
        f"- training domain: **{report['training_domain']}** (the first `--domain`); the others are untargeted",
        f"- reverted: every MoE router's weight, router bias and expert-correction bias"
        f"{', and the shared-expert gates' if report['shared_gates'] else ' (shared-expert gates left alone)'}",
        "",
        "Answer-span NLL (mean over rows of each row's mean over its answer tokens and turn end); top-k overlap to "
        "the base's routing on the same tokens (all tokens / question / answer); ΔNLL = reverted − post with a "
        f"{LEVEL:.0%} bootstrap interval over rows.",
        "",
        "| set | rows | "
        + " | ".join(f"NLL {v}" for v in names)
        + " | ΔNLL (reverted − post) | "
        + " | ".join(f"overlap {v} (all/Q/A)" for v in names)
        + " |",
        "|---" * (3 + 2 * len(names)) + "|",
    ]
    for name, e in report["sets"].items():
        v = e["variants"]
        d = e.get("delta_nll")
        delta = interval(d) if d else "—"
        label = f"{name} (trained)" if name == report["training_domain"] else name
        lines.append(
            f"| {label} | {e['rows']} | "
            + " | ".join(f"{v[n]['nll']:.4f}" for n in names)
            + f" | {delta} | "
            + " | ".join("/".join(f"{x:.3f}" for x in v[n]["topk_overlap"].values()) for n in names)
            + " |"
        )
    if report["generate"]:
        lines += [
            "",
            "Exact match (greedy decoding from each row's prompt):",
            "",
            "| set | budget (tokens) | " + " | ".join(names) + " |",
            "|---" * (2 + len(names)) + "|",
        ]
        for name, e in report["sets"].items():
            if "max_new_tokens" in e:
                lines.append(
                    f"| {name} | {e['max_new_tokens']} | "
                    + " | ".join(f"{e['variants'][n]['exact_match']:.3f}" for n in names)
                    + " |"
                )
    if "delta_nll_reverse" in next(iter(report["sets"].values())):
        lines += ["", "Reverse (the base with the post model's routers), ΔNLL = base+post routers − base:", ""]
        for name in report["sets"]:
            d = report["sets"][name]["delta_nll_reverse"]
            lines.append(f"- {name}: {interval(d)}")
    lines += [
        "",
        "A revert is an intervention on a model whose experts co-adapted with its routing, not a counterfactual "
        "training run: docs/retention.md.",
    ]
    if image:
        lines += ["", f"![ΔNLL from reverting]({image})"]
    return "\n".join(lines) + "\n"


def figure(report: dict, path: Path) -> Path:
    """ΔNLL from reverting per domain with its interval; the training domain drawn apart."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    names = _domains(report)
    est = [report["sets"][n]["delta_nll"]["estimate"] for n in names]
    ci = [report["sets"][n]["delta_nll"]["ci"] for n in names]
    fig, ax = plt.subplots(figsize=(1.2 + 0.9 * len(names), 3.2))
    colors = ["tab:red" if n == report["training_domain"] else "tab:blue" for n in names]
    ax.bar(range(len(names)), est, color=colors)
    ax.errorbar(
        range(len(names)),
        est,
        yerr=[
            [e - lo for e, (lo, _) in zip(est, ci, strict=True)],
            [hi - e for e, (_, hi) in zip(est, ci, strict=True)],
        ],
        fmt="none",
        ecolor="black",
        capsize=3,
    )
    ax.axhline(0, color="grey", lw=0.8)
    ax.set_xticks(range(len(names)), [f"{n}\n(trained)" if n == report["training_domain"] else n for n in names])
    ax.set_ylabel("ΔNLL: reverted − post")
    ax.set_title(f"Base routers put back ({LEVEL:.0%} bootstrap over rows)", fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def write_revert(report: dict, out: Path) -> None:
    figure(report, out / "revert.png")
    (out / "report.json").write_text(json.dumps(report, indent=1), encoding="utf-8")
    write_text_atomic(out / "report.md", markdown(report, "revert.png"))
