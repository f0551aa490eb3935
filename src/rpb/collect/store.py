"""The work directory of a collection in progress: ``<out>.partial/`` beside the artifact.

It holds ``manifest.json`` (everything the artifact's metadata will say, plus the chunk
size) and one small safetensors file per finished chunk of rows, named by its row range.
Every file appears under its final name only once complete (temporary file, fsync, rename),
so after ``kill -9`` at any moment the directory holds only whole chunks, and a rerun of
the same command computes just the missing ones. Chunk files carry no ``rpb`` metadata
key, so no reader takes one for an artifact; the artifact itself is assembled from the
chunks by streaming, without holding the prior in memory, and the directory is then removed.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import re
import shutil
import sys
from pathlib import Path

import torch
from safetensors import safe_open

from rpb.errors import RpbError
from rpb.fileio import write_text_atomic
from rpb.prior import NUM_SPANS
from rpb.prior.artifact import TensorSpec, atomic_save, stream_artifact

PARTIAL_SCHEMA = "rpb_prior_partial"
MANIFEST = "manifest.json"
CHUNK_KEY = "rpb_chunk"
_CHUNK_NAME = re.compile(r"rows-(\d{12})-(\d{12})\.safetensors")


class WorkDirError(RpbError):
    """The work directory cannot be resumed from as it stands (the message says how to start over)."""


class ResumeMismatchError(WorkDirError):
    """The work directory belongs to a collection with other arguments or data."""

    def __init__(self, path: Path, mismatches: list[tuple[str, object, object]]):
        self.mismatches = mismatches
        lines = [f"  {name}: the interrupted run has {old!r}, this run has {new!r}" for name, old, new in mismatches]
        super().__init__(
            f"{path} holds an interrupted collection that does not match this one "
            f"({len(mismatches)} mismatched field(s)):\n" + "\n".join(lines) + "\nrerun the interrupted command "
            f"unchanged to resume it, or delete {path} to start over"
        )


def work_dir_for(out_path: str | Path) -> Path:
    out_path = Path(out_path)
    return out_path.with_name(out_path.name + ".partial")


def chunk_ranges(num_rows: int, chunk_rows: int) -> list[tuple[int, int]]:
    """Row ranges ``[start, stop)`` of the chunks: fixed by the row count and chunk size alone,
    never by the number of processes, so a run may resume with another number of them."""
    if chunk_rows < 1:
        raise RpbError(f"--chunk-rows must be >= 1, got {chunk_rows}")
    return [(a, min(a + chunk_rows, num_rows)) for a in range(0, num_rows, chunk_rows)]


def _manifest(run: dict, chunk_rows: int) -> dict:
    return {"schema": PARTIAL_SCHEMA, "chunk_rows": int(chunk_rows), "run": run}


def _mismatches(recorded: dict, current: dict) -> list[tuple[str, object, object]]:
    """Fields of ``current`` that ``recorded`` has otherwise (a missing field is a mismatch)."""
    old_run, new_run = recorded.get("run", {}), current["run"]
    out = [("chunk_rows", recorded.get("chunk_rows"), current["chunk_rows"])]
    out += [(k, old_run.get(k), v) for k, v in sorted(new_run.items())]
    return [m for m in out if m[1] != m[2]]


class WorkDir:
    """``<out>.partial/`` for a collection whose artifact metadata will be ``run``."""

    def __init__(self, out_path: str | Path, run: dict, chunk_rows: int):
        self.out_path = Path(out_path)
        self.path = work_dir_for(out_path)
        self.manifest = _manifest(run, chunk_rows)
        self.chunks = chunk_ranges(run["num_rows"], chunk_rows)

    @property
    def manifest_sha256(self) -> str:
        return hashlib.sha256(json.dumps(self.manifest, sort_keys=True).encode()).hexdigest()

    def recorded(self) -> dict | None:
        """The manifest of an interrupted run in this directory, if there is one."""
        path = self.path / MANIFEST
        if not path.is_file():
            return None
        try:
            recorded = json.loads(path.read_text())
        except (json.JSONDecodeError, UnicodeDecodeError) as e:
            raise WorkDirError(f"{path}: not a readable manifest ({e}); delete {self.path} to start over") from None
        if not isinstance(recorded, dict) or recorded.get("schema") != PARTIAL_SCHEMA:
            raise WorkDirError(f"{path}: not an rpb collection manifest; delete {self.path} to start over")
        return recorded

    def check(self) -> None:
        """Refuse a directory left by a run that differs in any field of this one's ``run`` (a
        ``run`` of the fields known before the model loads checks just those) or in chunk size."""
        recorded = self.recorded()
        if recorded is not None and (mismatches := _mismatches(recorded, self.manifest)):
            raise ResumeMismatchError(self.path, mismatches)

    def prepare(self) -> None:
        """Create the directory and its manifest, or keep an existing one (checked by ``check``);
        drop temporary files that a killed process left. Run by one process, before any writes."""
        self.path.mkdir(parents=True, exist_ok=True)
        for tmp in self.path.glob(".*.partial"):
            tmp.unlink(missing_ok=True)
        if self.recorded() is None:
            write_text_atomic(self.path / MANIFEST, json.dumps(self.manifest, indent=1, sort_keys=True))

    def chunk_path(self, start: int, stop: int) -> Path:
        return self.path / f"rows-{start:012d}-{stop:012d}.safetensors"

    def done(self) -> set[tuple[int, int]]:
        """The chunks whose files are complete (other names are ignored)."""
        if not self.path.is_dir():
            return set()
        found = {tuple(int(g) for g in m.groups()) for p in self.path.iterdir() if (m := _CHUNK_NAME.fullmatch(p.name))}
        return found & set(self.chunks)

    def write_chunk(self, start: int, stop: int, prior: torch.Tensor, counts: torch.Tensor, sha: torch.Tensor) -> None:
        meta = {CHUNK_KEY: json.dumps({"rows": [start, stop], "manifest_sha256": self.manifest_sha256})}
        tensors = {"prior_qa": prior, "span_tokens": counts, "row_sha256": sha}
        atomic_save(tensors, meta, self.chunk_path(start, stop))

    def _read_chunk(self, start: int, stop: int, name: str, shape: tuple[int, ...]) -> torch.Tensor:
        path = self.chunk_path(start, stop)
        with safe_open(str(path), framework="pt") as f:
            meta = json.loads((f.metadata() or {}).get(CHUNK_KEY, "{}"))
            if meta.get("rows") != [start, stop] or meta.get("manifest_sha256") != self.manifest_sha256:
                raise WorkDirError(f"{path}: a chunk of another collection; delete {self.path} to start over")
            t = f.get_tensor(name)
        if tuple(t.shape) != (stop - start, *shape):
            raise WorkDirError(f"{path}: {name} has shape {tuple(t.shape)}, expected {(stop - start, *shape)}")
        return t

    def assemble(self, metadata: dict, num_layers: int, num_experts: int, row_digests: bytes) -> None:
        """Stream every chunk, in row order, into the artifact at ``out_path`` (atomically), hashing the
        tensor bytes as they go (``tensors_sha256``, patched into the header before the rename)."""
        missing = sorted(set(self.chunks) - self.done())
        if missing:
            raise WorkDirError(
                f"{self.path}: {len(missing)} chunk(s) missing, rows {missing[:5]}; on several nodes --out-path "
                "must be on a filesystem that every process shares; rerun to finish"
            )
        n = metadata["num_rows"]
        specs = [
            TensorSpec("prior_qa", torch.float32, (n, NUM_SPANS, num_layers, num_experts)),
            TensorSpec("span_tokens", torch.int64, (n, NUM_SPANS)),
            TensorSpec("row_sha256", torch.uint8, (n, 32)),
        ]

        def pieces(spec: TensorSpec):
            for a, b in self.chunks:
                t = self._read_chunk(a, b, spec.name, spec.shape[1:])
                if spec.name == "row_sha256" and t.numpy().tobytes() != row_digests[32 * a : 32 * b]:
                    raise WorkDirError(f"{self.chunk_path(a, b)}: computed on other rows than the data file's")
                yield t

        stream_artifact(self.out_path, specs, metadata, pieces, tmp_dir=self.path)

    def remove(self) -> None:
        shutil.rmtree(self.path, ignore_errors=True)

    def remove_if_empty(self) -> None:
        """Drop a directory that holds no finished chunk: there is nothing to resume from."""
        if self.path.is_dir() and not self.done():
            self.remove()


@contextlib.contextmanager
def missing_chunks(store: WorkDir, rk, what: str):
    """This rank's share of the chunks ``store`` still lacks (a list of row ranges), once the work directory is made
    (main rank) and checked on every rank; every rank lists the finished chunks before any rank writes one, and all
    meet again when their share is done. A run interrupted in one process keeps its finished chunks to resume from
    (an empty directory is dropped). ``what`` says in the log what a rank's rows are for. ``rk``: ``dist.Ranks``."""
    if rk.main:
        store.prepare()
    rk.barrier()
    store.check()  # every rank raises alike on a mismatch, so none waits at a barrier for another
    try:
        done = store.done()
        rk.barrier()
        todo = [c for c in store.chunks if c not in done][rk.rank :: rk.world]
        if done and rk.main:
            print(f"resuming {store.path}: {len(done)} of {len(store.chunks)} chunk(s) done", file=sys.stderr)
        if rk.world > 1:
            share = sum(b - a for a, b in todo)
            print(f"rank {rk.rank}/{rk.world}: {len(todo)} chunk(s), {share} row(s) {what}", file=sys.stderr)
        yield todo
        rk.barrier()
    except BaseException:
        if rk.world == 1:
            store.remove_if_empty()
        raise
