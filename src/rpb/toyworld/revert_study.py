"""One base of the ``revert`` grid (``rpb.toyworld.revert``): its cells trained as the ``full`` and ``rl`` grids train
them, scored as they score them, then reverted (``rpb.retention.revert_run``) on the grid's domains.

The RL arms train from the ``rl`` grid's start, made here by an ``RLStudy`` in ``rl/`` (its ``sft`` start at one
thread, its prompts), so their cells are that grid's cells; the ``full`` arms are ``Study``'s. A cell's record is
its scores and, under ``revert``, per reference (``base``, and the start for an RL arm) and domain: the answer
NLL, exact match and top-k overlap to the base of each variant, and the change in NLL from reverting with its
interval over rows. The per-row NLLs stay out (the run folder's report.json has them while the cell runs).
"""

from __future__ import annotations

import dataclasses
import shutil
from functools import cached_property
from pathlib import Path

from rpb.anchors import get_method
from rpb.errors import RpbError
from rpb.toyworld.experiment import Study
from rpb.toyworld.rl import RLArm
from rpb.toyworld.rl_study import RLStudy
from rpb.toyworld.tasks import answer_budget
from rpb.toyworld.world import eval_tasks, write_rows


@dataclasses.dataclass
class RevertStudy(Study):
    """One base of a ``RevertGrid``."""

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
        from rpb.toyworld.lanes import Job, run_jobs

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
        raise RpbError(f"grid {self.grid.name!r}: its report is across its bases (rpb.toyworld.revert_report)")


def _kept(entry: dict) -> dict:
    """A domain's figures without the per-row NLLs."""
    variants = {
        v: {"nll": f["nll"], "exact_match": f.get("exact_match"), "topk_overlap": f["topk_overlap"]["all"]}
        for v, f in entry["variants"].items()
    }
    d = entry["delta_nll"]
    return {"rows": entry["rows"], "variants": variants, "delta_nll": d["estimate"], "delta_nll_ci": d["ci"]}
