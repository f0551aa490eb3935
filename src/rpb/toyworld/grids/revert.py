"""``revert``: does the routing drift that post-training makes matter? Each arm's model is run with the
base's routers put back (``rpb retention --revert-routers``) on the trained set and the four pretraining domains.

Cells: the ``full`` grid's ``sft``, ``rpb`` and ``kl-to-base`` arms and the ``rl`` grid's plain GRPO and ``R3`` arms,
retrained on every base at seeds 42-44 (the grids ship no checkpoints) with the recipes of those grids, so each
cell's exact match should be the shipped cell's (bit for bit on the machine type that ran it; within ±2 points, or
the note says why not). ``kl-to-base`` takes the weight the ``full`` grid chose on validation, 0.01 on each base.
The RL arms start from the ``rl`` grid's ``sft`` start and are reverted both to the base's routers and to the
start's.

Domains: each set's test questions as the grids score them (500 of the trained set ``math_post``, 300 of each
pretraining domain), NLL on the answer span, exact match by greedy decoding within the grids' answer budget.

The claim (fixed before the grid's first cell, 2026-12-06): reverting an ``sft`` model's routers to the base's
(1) raises the trained domain's answer NLL and (2) lowers the untargeted domains' (the mean over math, code, text
and facts). Each is judged on the per-cell change (reverted minus post) with the grids' two-stage bootstrap over
the three bases and their seeds (``rpb.toyworld.study.stats.greater``), Holm across the two. The other arms' changes are
reported beside it, not judged.

One base (``RevertStudy``): its cells trained as the ``full`` and ``rl`` grids train them, scored as they score
them, then reverted (``rpb.retention.revert_run``) on the grid's domains. The RL arms train from the ``rl`` grid's
start, made here by an ``RLStudy`` in ``rl/`` (its ``sft`` start at one thread, its prompts), so their cells are
that grid's cells; the ``full`` arms are ``Study``'s. A cell's record is its scores and, under ``revert``, per
reference (``base``, and the start for an RL arm) and domain: the answer NLL, exact match and top-k overlap to the
base of each variant, and the change in NLL from reverting with its interval over rows. The per-row NLLs stay out
(the run folder's report.json has them while the cell runs).

The report (``report_revert``): tables.md, results.json, bases.json, revert.svg (the change in answer NLL from
reverting, per arm and domain, with the grids' two-stage bootstrap interval over bases and seeds) and claims.svg
(the claim, judged).
"""

from __future__ import annotations

import dataclasses
import functools
import json
import math
import shutil
from dataclasses import dataclass, field
from functools import cached_property
from pathlib import Path

import numpy as np

from rpb.anchors import get_method
from rpb.errors import RpbError
from rpb.toyworld.grids.rl import GRID as RL_GRID
from rpb.toyworld.study.cells import Study
from rpb.toyworld.study.claims import verdict_table
from rpb.toyworld.study.figures import CLAIMS, _figure, _style, _unique, claims, save
from rpb.toyworld.study.grid import BASES, SEEDS, STUDY_POST, Arm, Conduct
from rpb.toyworld.study.paired import SHIPPED_RESULTS
from rpb.toyworld.study.report import write_across
from rpb.toyworld.study.rl import RLGrid, RLStudy
from rpb.toyworld.study.stats import Verdict, greater, holm, interval, not_run, two_stage_bootstrap
from rpb.toyworld.study.tables import bases_table, machine_mix, mean_sd
from rpb.toyworld.world.generators import DOMAINS
from rpb.toyworld.world.post import PostRecipe, eval_tasks, write_rows
from rpb.toyworld.world.rl import RLArm, RLRecipe
from rpb.toyworld.world.tasks import answer_budget

#: the trained set of every arm (the RL arms' start was trained on it, and their prompts are its questions)
TRAINED = "math_post"
#: the weight the ``full`` grid chose for ``kl-to-base`` on validation, the same on its three bases
#: (docs/results/full/base*/selection.json; tests/toyworld/test_revert.py reads them)
KL_WEIGHT = 0.01
REVERT_ARMS = (
    Arm("sft", "sft"),
    Arm("rpb", "rpb"),
    Arm("kl-to-base", "kl-to-base"),
    RLArm("grpo"),
    RLArm("grpo + R3", replay="R3"),
)
#: what a reverted model is compared with: the base's routers, and (RL arms) their sft start's
REFERENCES = ("base", "start")


@dataclass(frozen=True)
class RevertGrid(Conduct):
    """The ``revert`` grid (module docstring); its fields are those the grids' runner and shipping read."""

    name: str
    sets: tuple[str, ...]
    arms: tuple[Arm | RLArm, ...]
    seeds: tuple[int, ...]
    bases: tuple[int, ...]
    post: PostRecipe
    coefficients: dict[str, float]
    #: the RL arms' recipe and start (the ``rl`` grid's)
    recipe: RLRecipe = field(default_factory=RLRecipe)
    start_seed: int = RL_GRID.start_seed
    domains: tuple[str, ...] = (TRAINED, *DOMAINS)

    def rl_grid(self) -> RLGrid:
        """The ``rl`` grid restricted to this grid's RL arms (what trains them, from the same start)."""
        arms = tuple(a for a in self.arms if isinstance(a, RLArm))
        return dataclasses.replace(RL_GRID, arms=arms, seeds=self.seeds, bases=self.bases, post=self.post)


def per_base(results: list[dict], arm: str, reference: str, domain: str, key: str = "delta_nll") -> dict:
    """{base: values of ``key`` for ``domain`` over the arm's cells} (a variant's figure as ``variant/figure``)."""
    out: dict[int, list[float]] = {}
    for r in sorted((r for r in results if r["arm"] == arm), key=lambda r: (r["base"], r["seed"])):
        entry = r["revert"].get(reference, {}).get(domain)
        if entry is None:
            continue
        if "/" in key:
            variant, figure = key.split("/")
            value = entry["variants"][variant][figure]
        else:
            value = entry[key]
        out.setdefault(r["base"], []).append(value)
    return out


def changes(results: list[dict], arm: str, domains: tuple[str, ...], reference: str = "base") -> dict[int, list]:
    """{base: per-cell change in answer NLL from reverting ``arm``'s routers to ``reference``'s, averaged over
    ``domains``}, cells in seed order."""
    each = [per_base(results, arm, reference, d) for d in domains]
    return {b: [sum(cell) / len(domains) for cell in zip(*(e[b] for e in each), strict=True)] for b in each[0]}


def judge_revert(results: list[dict]) -> list[Verdict]:
    """The claim (module docstring): two verdicts, Holm across them; "not run" while no sft cell is there."""
    claims = (
        ("reverting sft's routers raises the trained domain's NLL", (TRAINED,), 1),
        ("reverting sft's routers lowers the untargeted domains' NLL (mean of 4)", DOMAINS, -1),
    )
    verdicts = []
    for claim, domains, direction in claims:
        d = changes(results, "sft", domains)
        if not d:
            verdicts.append(not_run(claim))
            continue
        verdicts.append(greater(claim, d, direction, f"{sum(map(len, d.values()))} cells, ΔNLL nats/token"))
    return holm(verdicts)


@dataclasses.dataclass
class RevertStudy(Study):
    """One base of a ``RevertGrid``."""

    #: what a base ships besides the grids' files (``study.shipping``): its RL arms' start's record
    ships = ("rl/start/record.json",)

    @cached_property
    def rl(self) -> RLStudy:
        """What trains the RL arms: the ``rl`` grid's study restricted to them, in ``rl/``."""
        return RLStudy(self.out / "rl", self.grid.rl_grid(), self.post, self.cache_dir, False, base_seed=self.base_seed)

    def domain_file(self, domain: str) -> Path:
        """The domain's test questions as the grids score them (``world.score``), as JSONL rows."""
        path = self.out / "data" / "revert" / f"{domain}.jsonl"
        if not path.is_file():
            n = self.post.eval_id if domain in self.grid.sets else self.post.eval_ood
            write_rows(eval_tasks(domain, "test", n, self.post.base.domain_params()), path)
        return path

    def inputs(self) -> None:
        """What every lane reads, made once before the cells: the domains and the rpb arm's prior."""
        for d in self.grid.domains:
            self.domain_file(d)
        for post_set in self.grid.sets:
            self.prior(post_set)

    def rl_inputs(self) -> None:
        """What the RL cells read besides: their start (trained here, at one thread) and prompts."""
        self.rl.start()
        self.rl.prompts()

    def train(self, where: Path, post_set: str, arm, seed: int, anchor: dict):
        if isinstance(arm, RLArm):
            return self.rl.train(where, post_set, arm, seed, anchor)
        return super().train(where, post_set, arm, seed, anchor)

    def measure(self, where: Path, ckpt: Path, post_set: str, result: dict) -> dict:
        """The revert to the base's routers (and, an RL arm, to its start's) on every domain."""
        from rpb.retention.revert_run import run_revert

        references = {"base": self.base()} | ({"start": self.rl.start()} if "start_sha256" in result else {})
        domains = {d: self.domain_file(d) for d in self.grid.domains}
        budget = max(answer_budget(d) for d in domains)
        figures = {}
        for name, reference in references.items():
            report = run_revert(
                str(reference),
                str(ckpt),
                domains,
                where / f"revert_{name}",
                generate=True,
                max_new_tokens=budget,
                batch_size=64,
                max_seq_len=self.post.max_seq_len,
                progress=False,
            )
            figures[name] = {d: _kept(e) for d, e in report["sets"].items()}
            shutil.rmtree(where / f"revert_{name}", ignore_errors=True)
        return {"revert": figures}

    def _run(self) -> list[dict]:
        from rpb.toyworld.study.lanes import Job, run_jobs

        self.pin()
        g = self.grid
        me = self if self.lanes <= 1 else dataclasses.replace(self, progress=False)
        jobs = [Job(me.inputs, label="domains and prior"), Job(me.rl_inputs, label="the RL start and prompts")]
        for post_set, arm, seed in ((s, a, seed) for s in g.sets for a in g.arms for seed in g.seeds):
            after = (0, 1) if isinstance(arm, RLArm) else (0,)
            jobs.append(Job(me.grid_cell, (post_set, arm, seed), after, f"{arm.label} seed {seed}", True))
        return run_jobs(jobs, self.lanes)[2:]

    def select_weights(self, bar, only: str | None = None) -> dict[str, float]:
        methods = {a.method for a in self.grid.arms if get_method(a.method).coefficient}
        missing = methods - set(self.grid.coefficients)
        if missing:
            raise RpbError(f"grid {self.grid.name!r} fixes no weight for {sorted(missing)}")
        return {m: self.grid.coefficients[m] for m in methods if only in (None, m)}

    def report(self, results: list[dict]) -> str:
        raise RpbError(f"grid {self.grid.name!r}: its report is across its bases (rpb.toyworld.grids.revert)")


def _kept(entry: dict) -> dict:
    """A domain's figures without the per-row NLLs."""
    variants = {
        v: {"nll": f["nll"], "exact_match": f.get("exact_match"), "topk_overlap": f["topk_overlap"]["all"]}
        for v, f in entry["variants"].items()
    }
    d = entry["delta_nll"]
    return {"rows": entry["rows"], "variants": variants, "delta_nll": d["estimate"], "delta_nll_ci": d["ci"]}


REVERT_FIGURE = "revert.svg"
#: the shipped grid each arm's cells come from (their scores are the retrained cells' reference)
SOURCE_GRID = {"sft": "full", "rpb": "full", "kl-to-base": "full", "grpo": "rl", "grpo + R3": "rl"}


def _mean(results: list[dict], arm: str, reference: str, domain: str, key: str) -> float:
    return float(np.mean([v for vs in per_base(results, arm, reference, domain, key).values() for v in vs]))


def estimate(d: dict[int, list[float]]) -> tuple[float, float, float]:
    """The mean and the two-stage bootstrap interval (NaN where there is no cell); the same cells' bootstrap is
    drawn once for the tables and the figure."""
    return _estimate(tuple((b, tuple(v)) for b, v in sorted(d.items())))


@functools.lru_cache(maxsize=256)
def _estimate(frozen: tuple[tuple[int, tuple[float, ...]], ...]) -> tuple[float, float, float]:
    if not frozen:
        return math.nan, math.nan, math.nan
    d = {b: list(v) for b, v in frozen}
    lo, hi = interval(two_stage_bootstrap(d))
    return float(np.mean([v for vs in d.values() for v in vs])), lo, hi


def shipped_cell(result: dict, shipped: Path = SHIPPED_RESULTS) -> dict | None:
    """The shipped ``full`` / ``rl`` grid's cell this retrained cell repeats, if the repository ships it."""
    slug = result["arm"].replace(" + ", "+").replace(" ", "")
    path = shipped / SOURCE_GRID[result["arm"]] / f"base{result['base']}" / "runs" / result["set"] / slug
    path = path / f"seed{result['seed']}" / "result.json"
    return json.loads(path.read_text()) if path.is_file() else None


def scores_table(results: list[dict], arms: tuple[str, ...]) -> str:
    lines = [
        "### Exact match of the retrained cells (test part, points) beside the shipped cells they repeat",
        "",
        "| arm | cells | ID | OOD | largest \\|Δ\\| to the shipped cell, ID / OOD | cells bit-identical in score |",
        "|---|---|---|---|---|---|",
    ]
    for arm in arms:
        cells = [r for r in results if r["arm"] == arm]
        pairs = [(r, shipped_cell(r)) for r in cells]
        pairs = [(r, s) for r, s in pairs if s is not None]
        gaps = [max(abs(r[m] - s[m]) * 100 for r, s in pairs) if pairs else float("nan") for m in ("id", "ood")]
        same = sum(r["scores"] == s["scores"] for r, s in pairs)
        lines.append(
            f"| {arm} | {len(cells)} | {mean_sd([100 * r['id'] for r in cells])} | "
            f"{mean_sd([100 * r['ood'] for r in cells])} | {gaps[0]:.1f} / {gaps[1]:.1f} | {same} of {len(pairs)} |"
        )
    return "\n".join(lines) + "\n"


def delta_table(results: list[dict], arms: tuple[str, ...], domains: tuple[str, ...], reference: str) -> str:
    """ΔNLL (reverted − post, nats per answer token) per arm and domain, with the overlap to the base before and after
    and exact match before and after (points)."""
    other = "post+base routers"
    lines = [
        f"### Reverted to the {reference}'s routers: ΔNLL = reverted − post (answer span, nats/token), 95% two-stage "
        f"bootstrap over bases and seeds; top-k overlap to the {reference}'s routing and exact match (points), "
        "post → reverted",
        "",
        f"| arm | domain | ΔNLL | overlap to the {reference} | exact match |",
        "|---|---|---|---|---|",
    ]
    for arm in arms:
        for d in domains:
            delta = per_base(results, arm, reference, d)
            if not delta:
                continue
            est, lo, hi = estimate(delta)
            ov = [_mean(results, arm, reference, d, f"{v}/topk_overlap") for v in ("post", other)]
            em = [100 * _mean(results, arm, reference, d, f"{v}/exact_match") for v in ("post", other)]
            lines.append(
                f"| {arm} | {d}{' (trained)' if d == domains[0] else ''} | {est:+.4f} [{lo:+.4f}, {hi:+.4f}] | "
                f"{ov[0]:.3f} → {ov[1]:.3f} | {em[0]:.1f} → {em[1]:.1f} |"
            )
    return "\n".join(lines) + "\n"


def revert_figure(results: list[dict], domains: tuple[str, ...], title: str, arms: tuple[str, ...] = ()):
    """ΔNLL from reverting to the base's routers per domain (x) and arm (bars, in ``arms``' order, then any other
    arm of the cells), with intervals."""
    arms = _unique([*arms, *(r["arm"] for r in results)])
    with _style():
        fig = _figure(1.6 + 1.5 * len(domains), 3.6)
        ax = fig.subplots()
        width = 0.8 / max(len(arms), 1)
        for i, arm in enumerate(arms):
            found = [(j, estimate(per_base(results, arm, "base", d))) for j, d in enumerate(domains)]
            found = [(j, e) for j, e in found if not np.isnan(e[0])]
            xs = [j - 0.4 + width * (i + 0.5) for j, _ in found]
            est = [e[0] for _, e in found]
            err = [[e[0] - e[1] for _, e in found], [e[2] - e[0] for _, e in found]]
            ax.bar(xs, est, width, label=arm)
            ax.errorbar(xs, est, yerr=err, fmt="none", ecolor="black", capsize=2, lw=0.8)
        ax.axhline(0, color="grey", lw=0.8)
        ax.set_xticks(range(len(domains)), [f"{d}\n(trained)" if j == 0 else d for j, d in enumerate(domains)])
        ax.set_ylabel("ΔNLL, reverted − post (nats/token)")
        ax.set_title(f"{title}: the base's routers put back (95% two-stage bootstrap)")
        ax.legend(fontsize=7, ncol=len(arms))
    return fig


def report_revert(grid, studies: list, results: list[dict], out: Path) -> str:
    """tables.md, results.json, bases.json, revert.svg and claims.svg in ``out``; returns the tables."""
    arms = tuple(a.label for a in grid.arms)
    rl_arms = tuple(a for a in arms if any("start" in r["revert"] for r in results if r["arm"] == a))
    verdicts = judge_revert(results)
    parts = [
        f"# Toy-world study: grid `{grid.name}` on bases {[st.base_seed for st in studies]}",
        "",
        f"Each cell retrained as the shipped grid trains it ({', '.join(f'{a}: {SOURCE_GRID[a]}' for a in arms)}), "
        f"{len(grid.seeds)} seeds {list(grid.seeds)}, then run with the base's routers put back "
        "(`rpb retention --revert-routers`; the RL arms also with their sft start's). Domains: the trained set's "
        "500 test questions and 300 of each pretraining domain; NLL on the answer span (docs/retention.md).",
        "",
        bases_table(studies),
        scores_table(results, arms),
        delta_table(results, arms, grid.domains, "base"),
        delta_table(results, rl_arms, grid.domains, "start") if rl_arms else "",
        "### The claims, judged by rule (fixed before the first cell: rpb/toyworld/grids/revert.py)",
        "",
        verdict_table(verdicts, "claim (fixed before the grid ran)"),
        machine_mix(results),
        "",
        f"![ΔNLL from reverting]({REVERT_FIGURE})",
        "",
    ]
    tables = "\n".join(parts)
    out = Path(out)
    write_across(out, tables, results, studies, lambda c: {k: v for k, v in c.items() if k != "rl"})
    save(revert_figure(results, grid.domains, f"Grid `{grid.name}`", arms), out / REVERT_FIGURE)
    save(claims(verdicts, f"Grid `{grid.name}`"), out / CLAIMS)
    return tables


GRID = RevertGrid(
    "revert",
    (TRAINED,),
    REVERT_ARMS,
    SEEDS,
    BASES,
    STUDY_POST,
    {"kl-to-base": KL_WEIGHT},
    RL_GRID.recipe,
    about="the full grid's sft, rpb, kl-to-base and the rl grid's grpo, R3 retrained x 3 seeds x 3 bases, each run "
    "with the base's routers put back on the trained set and the four pretraining domains",
    study=RevertStudy,
    report=report_revert,
)
