"""Collection at scale: streamed, resumable after kill -9, sharded over processes, bucketed.

Every run is compared with an independent one: the single-process, uninterrupted collection
(same chunks and batches: equal bit for bit), or the unbucketed one-row-at-a-time collection
(other batches: equal within 1e-5). The artifact is read back with the safetensors library.
"""

import hashlib
import json
import os
import shutil
import signal
import struct
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file

from rpb.cli import main
from rpb.collect import collect, plan_batches
from rpb.collect.rows import index_rows, label_range, label_rows, scan_rows
from rpb.collect.store import WorkDir, work_dir_for
from rpb.data import ChatTemplate, DataError, load_labelled
from rpb.prior.artifact import ArtifactError, TensorSpec, read_metadata, stream_artifact, write_streamed
from rpb.testing.data import conversations, write_jsonl
from rpb.testing.models import build_tiny_model
from tests.conftest import write_rows

ROWS, CHUNK, BATCH, SEQ = 12, 3, 2, 256  # 4 chunks of 3 rows, 2 batches each


@pytest.fixture(scope="module")
def data(tmp_path_factory):
    return write_jsonl(conversations(ROWS, seed=11), tmp_path_factory.mktemp("data") / "train.jsonl")


@pytest.fixture(scope="module")
def reference(save_tiny, data, tmp_path_factory, one_thread):
    """The single-process, uninterrupted artifact, one intra-op thread like each launched process."""
    out = tmp_path_factory.mktemp("reference") / "prior.safetensors"
    collect(str(save_tiny("moonlight")), data, out, 2, SEQ, batch_size=BATCH, chunk_rows=CHUNK, progress=False)
    return load_file(out), read_metadata(out)


def cli_args(model, data, out, *extra):
    return [
        "collect",
        "--model",
        str(model),
        "--data-jsonl",
        str(data),
        "--out-path",
        str(out),
        "--top-k",
        "2",
        "--max-seq-len",
        str(SEQ),
        "--batch-size",
        str(BATCH),
        "--chunk-rows",
        str(CHUNK),
        "--no-progress",
        *extra,
    ]


def data_section_sha256(path) -> str:
    """sha256 of every byte after the header, read from the file's own bytes."""
    raw = Path(path).read_bytes()
    (header_len,) = struct.unpack("<Q", raw[:8])
    return hashlib.sha256(raw[8 + header_len :]).hexdigest()


def assert_same_artifact(out, reference):
    tensors, meta = reference
    got = load_file(out)  # the safetensors library reads what write_streamed wrote
    assert set(got) == set(tensors)
    for name in tensors:
        assert got[name].dtype == tensors[name].dtype and torch.equal(got[name], tensors[name]), name
    assert read_metadata(out) == meta
    assert meta["schema_version"] == 4 and meta["tensors_sha256"] == data_section_sha256(out)


def interrupt_after(monkeypatch, chunks: int):
    """Make the collector stop (as on Ctrl-C) once ``chunks`` chunk files are written."""
    original, written = WorkDir.write_chunk, []

    def write_chunk(self, *args):
        original(self, *args)
        written.append(args[:2])
        if len(written) == chunks:
            raise KeyboardInterrupt

    monkeypatch.setattr(WorkDir, "write_chunk", write_chunk)
    return written


# ---- the file format ----------------------------------------------------------------------------


def test_streamed_file_reads_like_save_file(tmp_path):
    gen = torch.Generator().manual_seed(0)
    tensors = {"a": torch.rand(7, 3, 5, generator=gen), "b": torch.arange(14).view(7, 2)}
    tensors["c"] = torch.arange(21, dtype=torch.uint8).view(7, 3)
    specs = [TensorSpec(k, v.dtype, tuple(v.shape)) for k, v in tensors.items()]
    out = tmp_path / "streamed.safetensors"
    write_streamed(out, specs, {"k": "v"}, lambda spec: tensors[spec.name].split([2, 4, 1]))
    got = load_file(out)
    assert all(torch.equal(got[k], v) for k, v in tensors.items())
    with safe_open(str(out), framework="pt") as f:
        assert f.metadata() == {"k": "v"}
    assert (8 + int.from_bytes(out.read_bytes()[:8], "little")) % 8 == 0  # data aligned: tensors view in place
    with pytest.raises(ValueError, match="bytes written"):
        write_streamed(tmp_path / "short.safetensors", specs, {}, lambda spec: [tensors[spec.name][:3]])
    assert not (tmp_path / "short.safetensors").exists() and sorted(p.name for p in tmp_path.iterdir()) == [out.name]


def test_a_streamed_artifact_gets_the_hash_of_its_bytes_in_place(tmp_path):
    """The header is written first, with a placeholder where the hash goes, patched once the bytes are out."""
    tensors = {"a": torch.rand(7, 3), "b": torch.arange(7)}
    specs = [TensorSpec(k, v.dtype, tuple(v.shape)) for k, v in tensors.items()]
    out = tmp_path / "streamed.safetensors"
    digest = stream_artifact(out, specs, {"schema": "s"}, lambda spec: tensors[spec.name].split([3, 4]))
    assert (
        digest
        == data_section_sha256(out)
        == hashlib.sha256(b"".join(t.numpy().tobytes() for t in tensors.values())).hexdigest()
    )
    assert read_metadata(out) == {"schema": "s", "tensors_sha256": digest}
    assert all(torch.equal(load_file(out)[k], v) for k, v in tensors.items())


#: the measurement, in a fresh interpreter: a process that ran other tests first may hand the copy memory its
#: allocator already holds, and the copy then adds no anonymous page (seen under pytest-xdist)
MAPPING_PROBE = """
import sys
from pathlib import Path

from rpb.prior.artifact import load_artifact


def anonymous_kib():
    for line in Path("/proc/self/smaps_rollup").read_text().splitlines():
        if line.startswith("Anonymous:"):
            return int(line.split()[1])


out, total = sys.argv[1], float(sys.argv[2])
before = anonymous_kib()
mapped = load_artifact(out)
assert float(mapped.prior_qa.sum()) == total  # every page read
after_mapped = anonymous_kib()
copied = load_artifact(out, mmap=False)  # the same measurement sees a copy
assert float(copied.prior_qa.sum()) == total
print(after_mapped - before, anonymous_kib() - before)
"""


@pytest.mark.skipif(not Path("/proc/self/smaps_rollup").exists(), reason="needs Linux /proc accounting")
def test_loaded_prior_is_a_file_mapping_not_a_copy(tmp_path):
    """The trainer's load: the prior's pages are the page cache's (shared by every rank), not this process's."""
    n, layers, experts = 4096, 16, 128  # 64 MiB of prior
    out = tmp_path / "big.safetensors"
    meta = {"rpb": json.dumps({"schema": "rpb_prior"})}
    specs = [TensorSpec("prior_qa", torch.float32, (n, 2, layers, experts))]
    specs += [TensorSpec("span_tokens", torch.int64, (n, 2)), TensorSpec("row_sha256", torch.uint8, (n, 32))]
    write_streamed(out, specs, meta, lambda s: [torch.full((512, *s.shape[1:]), 1, dtype=s.dtype)] * (n // 512))
    mib = specs[0].nbytes >> 10
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    done = subprocess.run([sys.executable, "-c", MAPPING_PROBE, str(out), str(n * 2 * layers * experts)],
                          capture_output=True, text=True, env=env, timeout=120)  # fmt: skip
    assert done.returncode == 0, done.stderr[-2000:]
    mapped_kib, copied_kib = map(int, done.stdout.split())
    assert mapped_kib < mib // 8
    assert copied_kib > mib * 7 // 8


# ---- rows ---------------------------------------------------------------------------------------


def test_row_scan_labels_like_load_labelled(moon_tok, data, tmp_path):
    template = ChatTemplate(moon_tok)
    rows = scan_rows(data, template, 100)  # truncates some rows
    full = load_labelled(data, moon_tok, 100)
    assert (rows.num_rows, rows.sha256, rows.num_tokens) == (full.num_rows, full.sha256, full.num_tokens)
    assert label_range(rows, template, 100, 0, rows.num_rows) == full.examples
    assert label_range(rows, template, 100, 5, 8) == full.examples[5:8]
    assert rows.examples is None  # not kept unless asked
    kept = scan_rows(data, template, 100, keep_tokens=full.num_tokens)
    assert list(kept.examples) == full.examples and label_range(kept, template, 100, 5, 8) == full.examples[5:8]
    assert scan_rows(data, template, 100, keep_tokens=full.num_tokens - 1).examples is None  # one token too many
    bad = write_rows(tmp_path / "bad.jsonl", [conversations(1)[0], "not json", {"messages": []}, "\xff"])
    bad.write_bytes(bad.read_bytes().replace("\xff".encode(), b"\xff"))  # a line that is not UTF-8
    with pytest.raises(DataError) as scanned:
        scan_rows(bad, template, 64)
    with pytest.raises(DataError) as loaded:
        load_labelled(bad, moon_tok, 64)
    assert str(scanned.value) == str(loaded.value)
    assert scanned.value.kinds == ["empty-a-span", "malformed-json", "malformed-messages", "malformed-json"]


def test_an_index_without_labelling_reads_back_the_same_rows(moon_tok, data):
    template = ChatTemplate(moon_tok)
    scanned, indexed = scan_rows(data, template, 100), index_rows(data)
    assert (indexed.sha256, indexed.offsets, indexed.digests) == (scanned.sha256, scanned.offsets, scanned.digests)
    assert indexed.sha256 == hashlib.sha256(Path(data).read_bytes()).hexdigest() and indexed.num_tokens is None
    assert label_rows(indexed, template, 100, [7, 2]) == [
        load_labelled(data, moon_tok, 100).examples[i] for i in (7, 2)
    ]


# ---- batching -----------------------------------------------------------------------------------


def test_batch_size_and_bucketing_do_not_change_the_prior(save_tiny, data, moon_tok, tmp_path, one_thread):
    model = str(save_tiny("moonlight"))
    lengths = [len(e) for e in load_labelled(data, moon_tok, SEQ).examples]
    bucketed, plain = plan_batches(lengths, 4), plan_batches(lengths, 4, bucket=False)
    assert sorted(i for b in bucketed for i in b) == list(range(ROWS)) and bucketed != plain

    def padded(plan):
        return sum(len(b) * max(lengths[i] for i in b) for b in plan)

    assert padded(bucketed) < padded(plain)  # the point of bucketing, on this very data

    one_by_one = collect(model, data, tmp_path / "ref.safetensors", 2, SEQ, batch_size=1, bucket=False, progress=False)
    for batch_size, bucket, chunk_rows in ((5, True, 4), (16, True, 7), (3, False, 5), (12, True, 256)):
        out = tmp_path / f"{batch_size}-{bucket}-{chunk_rows}.safetensors"
        art = collect(
            model, data, out, 2, SEQ, batch_size=batch_size, bucket=bucket, chunk_rows=chunk_rows, progress=False
        )
        torch.testing.assert_close(art.prior_qa, one_by_one.prior_qa, atol=1e-5, rtol=0)
        assert torch.equal(art.span_tokens, one_by_one.span_tokens)
        assert torch.equal(art.row_sha256, one_by_one.row_sha256)


# ---- resuming -----------------------------------------------------------------------------------


def test_interrupted_run_resumes_and_refuses_changes(
    save_tiny, moon_tok, data, reference, tmp_path, monkeypatch, capsys
):
    model = tmp_path / "model"
    shutil.copytree(save_tiny("moonlight"), model)
    out = tmp_path / "prior.safetensors"
    work = work_dir_for(out)
    written = interrupt_after(monkeypatch, 2)
    with pytest.raises(KeyboardInterrupt):
        main(cli_args(model, data, out))
    assert written == [(0, 3), (3, 6)] and not out.exists()
    chunks = sorted(work.glob("rows-*.safetensors"))
    assert [c.name for c in chunks] == [f"rows-{a:012d}-{b:012d}.safetensors" for a, b in ((0, 3), (3, 6))]
    with pytest.raises(ArtifactError, match="not an rpb prior artifact"):  # partial output is never a prior
        read_metadata(chunks[0])
    monkeypatch.undo()
    stamps = {c: c.stat().st_mtime_ns for c in chunks}

    # changed arguments, data or weights: refused, every mismatched field named, nothing touched
    capsys.readouterr()
    assert main(cli_args(model, data, out, "--max-seq-len", "128", "--router-transform", "sigmoid-normalized")) == 2
    err = capsys.readouterr().err
    assert f"{work} holds an interrupted collection that does not match" in err and "mismatched field(s)" in err
    assert "max_seq_len: the interrupted run has 256, this run has 128" in err and "router_transform" in err
    assert f"delete {work} to start over" in err
    lines = data.read_text().splitlines()
    edited = write_rows(tmp_path / "train.jsonl", [*lines[:-1], lines[0]])  # same name and row count
    assert main(cli_args(model, edited, out)) == 2 and "data_sha256" in capsys.readouterr().err
    assert main(cli_args(model, data, out, "--chunk-rows", "4")) == 2 and "chunk_rows" in capsys.readouterr().err
    weights = model / "model.safetensors"
    saved = weights.read_bytes()
    build_tiny_model("moonlight", vocab_size=len(moon_tok), seed=5).save_pretrained(model)  # same config, other routers
    assert main(cli_args(model, data, out)) == 2 and "routers_sha256" in capsys.readouterr().err
    weights.write_bytes(saved)
    assert {c: c.stat().st_mtime_ns for c in work.glob("rows-*.safetensors")} == stamps and not out.exists()

    # the same command again: only the missing chunks run, and the artifact is the uninterrupted one
    written = interrupt_after(monkeypatch, -1)  # records, never interrupts
    assert main(cli_args(model, data, out)) == 0
    assert f"resuming {work}: 2 of 4 chunk(s) done" in capsys.readouterr().err
    assert written == [(6, 9), (9, 12)] and not work.exists()
    tensors, meta = reference
    assert_same_artifact(out, (tensors, {**meta, "model": str(model), "tokenizer": str(model)}))


KILLER = """
import os, signal, sys
import rpb.prior.artifact, rpb.collect.store
from rpb.cli import main

where, k = os.environ["RPB_TEST_KILL"].split(":")
calls = []

def kill_after(owner, name):
    original = getattr(owner, name)
    def wrapper(*args, **kwargs):
        out = original(*args, **kwargs)
        calls.append(name)
        if len(calls) == int(k):
            os.kill(os.getpid(), signal.SIGKILL)
        return out
    setattr(owner, name, wrapper)

if where == "chunk-written-not-renamed":
    kill_after(rpb.prior.artifact, "save_file")
elif where == "chunk-renamed":
    kill_after(rpb.collect.store.WorkDir, "write_chunk")
elif where == "assembly":
    kill_after(rpb.collect.store.WorkDir, "_read_chunk")
sys.exit(main(sys.argv[1:]))
"""


def run_cli(args, kill=None, torchrun=False):
    env = {**os.environ, "OMP_NUM_THREADS": "1", "RPB_TEST_KILL": kill or "none:0"}
    launcher = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2", "-m", "rpb"]
    cmd = [*launcher, *args] if torchrun else [sys.executable, "-c", KILLER, *args]
    return subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=180)


def test_killed_run_resumes_to_the_same_artifact(save_tiny, data, reference, tmp_path):
    """kill -9 between a chunk's write and its rename, after a chunk, and mid-assembly; then finish."""
    out = tmp_path / "prior.safetensors"
    work = work_dir_for(out)
    args = cli_args(save_tiny("moonlight"), data, out)

    def state():
        names = sorted(p.name for p in work.iterdir())
        return [n for n in names if not n.startswith(".")], [n for n in names if n.startswith(".")], out.exists()

    done = run_cli(args, kill="chunk-written-not-renamed:2")
    assert done.returncode == -signal.SIGKILL, done.stderr[-2000:]
    names, temp, finished = state()
    assert not finished and names == ["manifest.json", "rows-000000000000-000000000003.safetensors"]
    assert len(temp) == 1 and temp[0].startswith(".rows-000000000003-000000000006.safetensors.")  # the torn write

    done = run_cli(args, kill="chunk-renamed:1")
    assert done.returncode == -signal.SIGKILL and "resuming" in done.stderr and "1 of 4 chunk(s) done" in done.stderr
    names, temp, finished = state()
    assert not finished and len(names) == 3 and not temp  # the torn file is gone

    done = run_cli(args, kill="assembly:3")  # two chunks more, then killed while writing the artifact
    assert done.returncode == -signal.SIGKILL and "2 of 4 chunk(s) done" in done.stderr
    names, temp, finished = state()
    assert not finished and len(names) == 5  # the manifest and every chunk
    assert len(temp) == 1 and temp[0].startswith(".prior.safetensors.")  # the half-written artifact, under a temp name

    done = run_cli(args)
    assert done.returncode == 0, done.stderr[-2000:]
    assert "4 of 4 chunk(s) done" in done.stderr and not work.exists()
    assert_same_artifact(out, reference)


# ---- sharding -----------------------------------------------------------------------------------


#: one launch, two commands: a process group costs seconds to start, and both commands share its machinery
TWO_COMMANDS = """
import json, sys
import torch.distributed as dist
from rpb.cli import main
dist.init_process_group("gloo")  # one group for both: each command then keeps it, as under a trainer's own
for args in json.loads(sys.argv[1]):
    if main(args) != 0:
        sys.exit(1)
"""


def test_two_processes_match_one(save_tiny, data, reference, tmp_path):
    """``rpb collect`` and ``rpb routes --chunk-rows`` under torchrun: each rank its share of the chunks, and what
    they write is what one process writes."""
    from rpb.replay.routeshards import open_routes

    model = save_tiny("moonlight")
    out, shards, single = tmp_path / "prior.safetensors", tmp_path / "routes", tmp_path / "routes.safetensors"
    routes = ["routes", "--model", str(model), "--data-jsonl", str(data), "--max-seq-len", "256", "--with-probs"]
    assert main([*routes, "--out", str(single)]) == 0
    script = tmp_path / "two.py"
    script.write_text(TWO_COMMANDS)
    launch = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2", str(script)]
    jobs = json.dumps([cli_args(model, data, out), [*routes, "--out", str(shards), "--chunk-rows", "3"]])
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    done = subprocess.run([*launch, jobs], capture_output=True, text=True, env=env, timeout=120)
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-2000:]
    assert done.stdout.count(f"wrote {out}") == 1 and not work_dir_for(out).exists()
    assert "rank 0/2: 2 chunk(s), 6 row(s) to collect" in done.stderr
    assert "rank 1/2: 2 chunk(s), 6 row(s) to collect" in done.stderr
    assert_same_artifact(out, reference)
    assert "rank 0/2: 2 chunk(s), 6 row(s) to route" in done.stderr and not work_dir_for(shards).exists()
    one, sharded = open_routes(single), open_routes(shards)
    for name in ("routes", "probs", "token_ids"):
        assert torch.equal(one.whole(name), sharded.whole(name)), name
