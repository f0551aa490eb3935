"""Distributed training on CPU with gloo: DDP via ``rpb train`` under torchrun, and FSDP2 sharding."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from rpb.anchors import AnchorConfig, install_anchor
from rpb.collect import collect
from rpb.testing.data import conversations, write_jsonl
from rpb.testing.models import build_tiny_model
from tests.conftest import coefficient_overrides
from tests.workers.fsdp_worker import batch, moved_routers, perturb_routers

TORCHRUN = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2"]
FSDP_WORKER = Path(__file__).parents[1] / "workers" / "fsdp_worker.py"


def run(cmd, check=True, **kw):
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    try:
        done = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=180, **kw)
    except subprocess.TimeoutExpired as err:  # a hang: say where the ranks had got to
        tails = [(out.decode(errors="replace") if isinstance(out, bytes) else out or "")[-3000:]
                 for out in (err.stdout, err.stderr)]  # fmt: skip
        said = f"stdout:\n{tails[0]}\nstderr:\n{tails[1]}"
        pytest.fail(f"{' '.join(map(str, cmd))[:400]}: no exit after {err.timeout} s\n{said}")
    if check:
        assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    return done


FSDP = ["train.fsdp=full_shard auto_wrap",
        'train.fsdp_config={"version": 2, "transformer_layer_cls_to_wrap": ["DeepseekV3DecoderLayer"]}']  # fmt: skip


@pytest.fixture(scope="module")
def one_process(save_tiny, tmp_path_factory):
    """``one(method)``: the data, the prior, the run's shared settings and the one-process run of ``method`` with
    the global batch of 4, made once for every two-process run it is compared with."""
    tmp = tmp_path_factory.mktemp("one")
    model = save_tiny("moonlight")
    data = write_jsonl(conversations(16, seed=7), tmp / "train.jsonl")
    prior = tmp / "prior.safetensors"
    collect(str(model), data, prior, top_k=2, max_seq_len=192, progress=False)
    done = {}

    def one(method: str, *extra: str) -> tuple[list[str], Path]:
        common = [f"model={model}", f"data_jsonl={data}", f"prior={prior}", f"anchor.method={method}",
                  *coefficient_overrides(method, 0.1, 0.01), "train.max_steps=3", "train.lr=1e-3", "train.log_every=1",
                  "--no-progress", *extra]  # fmt: skip
        if method not in done:
            done[method] = tmp / method
            run([sys.executable, "-m", "rpb", "train", f"output_dir={done[method]}", "train.batch_size=4", *common])
        return common, done[method]

    return model, one


@pytest.mark.parametrize(("method", "sharding"), [("rpb", []), ("router-l2", []), ("rpb", FSDP)])
def test_two_processes_match_one(method, sharding, one_process, tmp_path):
    """DDP (and FSDP2 through the Trainer) with 2 gloo processes == 1 process with the same global batch."""
    model, one_run = one_process
    common, single = one_run(method)
    run([*TORCHRUN, "-m", "rpb", "train", f"output_dir={tmp_path / 'two'}", "train.batch_size=2", *common, *sharding])
    two, one = load_file(tmp_path / "two" / "model.safetensors"), load_file(single / "model.safetensors")
    base = load_file(Path(model) / "model.safetensors")
    assert not all(torch.equal(base[k], one[k]) for k in base)  # it trained
    assert max(float((two[k] - one[k]).abs().max()) for k in one) <= 1e-5
    # the routing figures count both ranks' tokens: step 1 (identical weights) logs what one process logs
    first = [next(json.loads(line) for line in (run_ / "log.jsonl").read_text().splitlines()
                  if "loss" in json.loads(line)) for run_ in (tmp_path / "two", single)]  # fmt: skip
    figures = {k for k in first[1] if k.startswith("moe/")}
    assert {"moe/layer_1/load_cv", "moe/layer_2/dead_experts"} <= figures
    assert ("moe/mean/bias_changed_fraction" in figures) == (method == "rpb")  # router-l2 reads no prior
    if method == "router-l2":
        assert "moe/layer_1/base_topk_overlap_current_hidden" in figures
    assert figures == {k for k in first[0] if k.startswith("moe/")}
    assert all(first[0][k] == pytest.approx(first[1][k], abs=1e-6) for k in figures), (first[0], first[1])


@pytest.fixture(scope="module")
def fsdp_runs(tmp_path_factory):
    """The FSDP worker's files: its sharded steps (``rpb``, ``kl-to-base``) and monitor figures, from one launch."""
    out = tmp_path_factory.mktemp("fsdp")
    return out, run([*TORCHRUN, str(FSDP_WORKER), str(out)], check=False)


def worker_file(fsdp_runs, name: str) -> Path:
    """One of the worker's files; a worker that failed fails each test that reads it (in the test, not in the
    fixture: a failing fixture reads as an error, not as a failed check)."""
    out, done = fsdp_runs
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    return out / name


@pytest.mark.parametrize("method", ["rpb", "kl-to-base"])
def test_fsdp2_sharded_install_matches_unsharded(method, fsdp_runs):
    sharded = load_file(worker_file(fsdp_runs, f"{method}.safetensors"))
    # the same step without sharding, in this process
    model = build_tiny_model("moonlight", 107).train()
    prior = torch.softmax(torch.randn(4, 2, 2, 8, generator=torch.Generator().manual_seed(1)) * 3, -1)
    handle = install_anchor(model, AnchorConfig.for_method(method, lambda_=0.5), prior=prior)
    perturb_routers(model)
    ids, sample, span = batch()
    grads, losses = {}, []
    for rows in (slice(0, 2), slice(2, 4)):  # two half-batches, averaged like DDP/FSDP do
        model.zero_grad()
        with handle.step(sample[rows], span[rows], torch.ones_like(ids[rows])):
            out_ = model(input_ids=ids[rows], labels=ids[rows])
            term = handle.loss()
            (out_.loss + term).backward()
        losses.append(torch.stack([out_.loss.detach(), term.detach()]))
        for n, p in model.named_parameters():
            if n.endswith("mlp.gate.weight"):
                grads[n] = grads.get(n, 0) + p.grad / 2
    torch.testing.assert_close(sharded["loss"], torch.stack(losses).mean(0), atol=1e-5, rtol=0)
    assert set(grads) == set(sharded) - {"loss"}
    for n, g in grads.items():
        torch.testing.assert_close(sharded[n], g, atol=1e-5, rtol=0)
    if method == "kl-to-base":
        assert float(sharded["loss"][1]) > 0  # the base copies were used while the weights were sharded


def test_the_monitor_under_fsdp2_copies_whole_routers_and_counts_both_ranks(fsdp_runs):
    """Built after sharding (as the Trainer's callback is), the monitor's base copy is the whole router, and its
    figures over two ranks' rows equal one process's over all four."""
    from rpb.monitor import RoutingMonitor

    sharded = json.loads(worker_file(fsdp_runs, "monitor.json").read_text())
    model = build_tiny_model("moonlight", 107).train()
    monitor = RoutingMonitor(model).attach()
    moved_routers(model, sharded=False)
    ids, _, span = batch()
    with torch.no_grad():
        model(input_ids=ids, labels=torch.where(span == 1, ids, -100))
    whole = monitor.flush()
    assert whole["routing/min/topk_overlap"] < 1 and whole["routing/mean/kl"] > 0  # the routers did move
    assert sharded.keys() == whole.keys()
    assert all(sharded[k] == pytest.approx(whole[k], abs=1e-6) for k in whole), (sharded, whole)


def test_a_routing_target_steps_the_same_lambda_on_two_processes_as_on_one(one_process, tmp_path):
    """routing-kd with anchor.target, the two processes under FSDP2: each optimizer step's overlap is summed over
    the ranks before the controller reads it, so both ranks log the overlap and the λ sequence one process logs on
    the whole batch; the monitor, on with no configuration, logs the base-forward figures one process logs."""
    _, one_run = one_process
    # two steps: the base, then one update (later ones let the two runs' float sums differ at near-tied choices)
    common, single = one_run("routing-kd", "anchor.target=0.999", "train.max_steps=2")
    run([*TORCHRUN, "-m", "rpb", "train", f"output_dir={tmp_path / 'two'}", "train.batch_size=2", *common, *FSDP])
    logs = [[json.loads(line) for line in (run_ / "log.jsonl").read_text().splitlines() if '"anchor/lambda"' in line]
            for run_ in (tmp_path / "two", single)]  # fmt: skip
    assert len(logs[0]) == len(logs[1]) == 2
    for key in ("anchor/overlap", "anchor/overlap_min", "anchor/lambda", "routing/mean/base_forward_topk_overlap",
                "routing/mean/topk_overlap"):  # fmt: skip
        assert [r[key] for r in logs[0]] == pytest.approx([r[key] for r in logs[1]], abs=1e-6), key
    assert logs[1][0]["anchor/overlap"] == 1.0 and logs[1][-1]["anchor/lambda"] != 1.0  # it moved, and λ with it
