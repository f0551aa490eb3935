"""What a study's cells share, made once per output directory (``rpb.toyworld.study.cells.Study`` runs the cells)."""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass, field
from functools import cached_property
from pathlib import Path

from rpb.data import file_sha256
from rpb.fileio import write_json_atomic
from rpb.toyworld.study.grid import BETAS, Grid
from rpb.toyworld.world.post import PostRecipe, ensure_base, probe_tasks, score, write_rows
from rpb.toyworld.world.tasks import TRACE_SETS, sample


@dataclass
class StudyInputs:
    """One output directory's inputs, shared by its cells: the base, the post-training data, the probe set, the
    routing priors, the calibration and the base's own scores and routing. Each is written once into the
    directory, the first time it is asked for, and read back after."""

    out: Path
    grid: Grid
    post: PostRecipe = field(default_factory=PostRecipe)
    cache_dir: Path | None = None
    progress: bool = True
    keep_checkpoints: bool = False
    #: the seed of the base recipe (the toy world's bases 0, 1 and 2)
    base_seed: int = 0
    #: take the repository's shipped base for this recipe when the cache has none (False: pretrain it here)
    shipped: bool = True
    #: cells (and the calibration, the base's own scores) run side by side in this many processes, the usable
    #: cores shared out among them (rpb.toyworld.study.lanes); 1: one after another in this process
    lanes: int = 1

    def __post_init__(self):
        self.out = Path(self.out)
        if self.post.base.seed != self.base_seed:
            self.post = dataclasses.replace(self.post, base=dataclasses.replace(self.post.base, seed=self.base_seed))

    @cached_property
    def _built_base(self) -> tuple[Path, dict]:
        return ensure_base(self.post.base, self.cache_dir, self.progress, self.shipped)

    @property
    def base_record(self) -> dict:
        """The base model's pretraining record (recipe.json), building the base first if need be."""
        return self._built_base[1]

    def base(self) -> Path:
        return self._built_base[0]

    def data(self, post_set: str) -> Path:
        path = self.out / "data" / f"{post_set}.train.jsonl"
        if not path.is_file():
            write_rows(sample(post_set, self.post.train_rows, seed=self.post.data_seed), path)
        return path

    @property
    def trace_set(self) -> str | None:
        """The grid's trace set (``TRACE_SETS``), if it has one: then retention is measured on its
        traces and carries the transition levels."""
        return next((s for s in self.grid.sets if s in TRACE_SETS), None)

    def probe(self) -> Path:
        path = self.out / "data" / "probe.jsonl"
        if not path.is_file():
            write_rows(probe_tasks(self.post, self.trace_set), path)
        return path

    def prior(self, post_set: str, kind: str = "probability") -> Path:
        """The base's prior over the set's training data: its router probabilities (eq. 2), or (``kind``
        frequency) its selection frequency, what an engine's routes give."""
        from rpb.collect import collect

        name = f"{post_set}.safetensors" if kind == "probability" else f"{post_set}.{kind}.safetensors"
        path = self.out / "priors" / name
        if not path.is_file():  # written atomically: present means complete
            collect(
                str(self.base()),
                self.data(post_set),
                path,
                top_k=self.post.base.num_experts_per_tok,
                max_seq_len=self.post.max_seq_len,
                batch_size=64,
                progress=self.progress,
                prior_kind=kind,
            )
        return path

    def base_routing(self) -> dict:
        """``rpb retention`` of the base alone on the probe set: the structure post-training should keep."""
        from rpb.retention.run import run_retention

        path = self.out / "base_routing" / "report.json"
        try:
            return json.loads(path.read_text())
        except (OSError, ValueError):  # absent, or cut short by an interruption
            return run_retention(
                str(self.base()),
                self.probe(),
                path.parent,
                batch_size=64,
                max_seq_len=self.post.max_seq_len,
                progress=False,
            )

    def calibration(self, post_set: str) -> dict:
        """``rpb calibrate`` of the base on the set's prior and data (calibration/<set>/calibrate.json),
        over the nonzero ``BETAS``: its rule gives the calibrated arm's beta."""
        from rpb.calibrate import calibrate

        path = self.out / "calibration" / post_set / "calibrate.json"
        if not path.is_file():  # written last: present means finished
            calibrate(
                str(self.base()),
                self.prior(post_set),
                self.data(post_set),
                out=path.parent,
                betas=[b for b in BETAS if b > 0],
                batch_size=64,
                progress=self.progress,
            )
        return json.loads(path.read_text())

    def calibrated_beta(self, post_set: str) -> float:
        return float(self.calibration(post_set)["recommended_beta"])

    def base_facts(self) -> dict:
        """The base itself: its weights' hash, held-out exact match per domain, routing structure."""
        from rpb.toyworld.world.post import between_domain_jsd

        path = self.out / "base_facts.json"
        if not path.is_file():
            routing = self.base_routing()["mean"]
            facts = {
                "seed": self.base_seed,
                "weights_sha256": file_sha256(self.base() / "model.safetensors"),
                "heldout_exact_match": self.base_record["heldout_exact_match"],
                "modularity": routing["modularity_base"],
                "communities": routing["communities_base"],
                "between_domain_jsd_bits": between_domain_jsd(self.base(), self.post),
            }
            write_json_atomic(path, facts)
        return json.loads(path.read_text())

    def base_score(self, post_set: str) -> dict:
        """The base model's ID / OOD exact match on the test questions: where post-training starts."""
        path = self.out / "base_scores" / f"{post_set}.json"
        if not path.is_file():
            write_json_atomic(path, score(self.base(), post_set, self.post, "test"))
        return json.loads(path.read_text())
