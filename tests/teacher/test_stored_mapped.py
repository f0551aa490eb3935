"""Stored routes at the size people train: the route file is read a batch's rows at a time from safetensors' map of
the file, never whole. Shown under ``RLIMIT_DATA`` (private writable memory: the heap and anonymous maps; a read-only
map of the file does not count against it, and ``RLIMIT_AS`` would count it and torch alone): a process whose data
limit leaves less room than the route file's size checks the file and trains two steps from it."""

from __future__ import annotations

import ctypes
import multiprocessing
import resource

import pytest
import torch

from rpb.adapters import find_moe_layers, get_adapter, routers_sha256
from rpb.anchors import AnchorConfig, install_anchor
from rpb.collect.hf_routes import write_routes
from rpb.data import load_labelled
from rpb.models import load_causal_lm, load_tokenizer
from rpb.teacher import load_stored_routes
from rpb.testing.data import conversations, write_jsonl
from tests.project.test_family_matrix import MAX_LEN, batch_of

pytestmark = pytest.mark.usefixtures("one_thread")
EXPERTS = 512  # a wide router, so that the whole distribution makes a large file from few rows
ROOM = 16 * 2**20  # the data limit's room above what the process holds before the file is opened
M_MMAP_THRESHOLD = -3  # glibc's mallopt parameter
HELD_AT_MOST = 8 * 2**30  # past this the limit is not binding here at all, which the test reports


def vm_data() -> int:
    return next(int(line.split()[1]) * 1024 for line in open("/proc/self/status") if line.startswith("VmData:"))


def hold_the_free_heap() -> list[torch.Tensor]:
    """Every block the allocator still hands out with the data limit at what the process holds now, taken and kept
    (memory freed earlier inside the process's mappings, which the limit does not see: a forked test worker's heap
    holds what its earlier tests freed), so that what the limit leaves is the room above it. Returns the blocks,
    which the caller keeps for as long as the limit is to bind."""
    here = vm_data()
    resource.setrlimit(resource.RLIMIT_DATA, (here, resource.RLIM_INFINITY))
    size, held = 1 << 30, []
    while size >= 1 << 16 and sum(map(len, held)) < HELD_AT_MOST:
        try:
            held.append(torch.empty(size, dtype=torch.uint8))  # never written: address space, no resident pages
        except RuntimeError:
            size //= 2
    resource.setrlimit(resource.RLIMIT_DATA, (resource.RLIM_INFINITY, resource.RLIM_INFINITY))
    return held


def train_two_steps_under_the_limit(model_dir, data, small, big, done) -> None:
    """In a forked child: one step from the small file (the optimizer's state and the allocator's pools made), then
    the data limit set to what the process holds plus ``ROOM``, then the big file checked and two steps trained."""
    model = load_causal_lm(str(model_dir)).train()
    facts = get_adapter(model.config.model_type)
    layers = find_moe_layers(model, facts)
    fingerprint = routers_sha256(layers, facts)  # the base's, before any step moves the routers
    labelled = load_labelled(str(data), load_tokenizer(str(model_dir)), MAX_LEN)
    config = AnchorConfig(method="routing-kd", lambda_=1.0, base="routes", routes=str(big), router_transform="softmax")
    handle = install_anchor(model, config)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    batches = [batch_of(model_dir, data, rows=2)] * 3

    def teacher(path):
        return load_stored_routes(
            path, labelled, routers_sha256=fingerprint, moe_layers=[m.layer_index for m in layers],
            num_layers=model.config.num_hidden_layers, top_k=handle.layers[0].spec.top_k, num_experts=EXPERTS,
            transform=handle.router_transform,
        )  # fmt: skip

    def step(batch) -> float:
        with handle.step(batch["rpb_sample_index"], batch["rpb_span"], batch["attention_mask"]) as ctx:
            ctx.base = handle.base_routing(batch, batch["rpb_sample_index"])
            out = model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"], labels=batch["labels"])
            term = handle.loss()
            (out.loss + term).backward()
        optimizer.step()
        optimizer.zero_grad()
        return float(term.detach())

    handle.teacher = teacher(small)
    step(batches[0])
    libc = ctypes.CDLL(None)
    libc.mallopt(M_MMAP_THRESHOLD, 128 * 1024)  # large blocks mapped and unmapped, never kept in the heap
    libc.malloc_trim(0)  # the heap's free top given back, so that the data size is what the process holds
    held = hold_the_free_heap()  # kept to the end of the child
    taken = sum(map(len, held))
    if taken >= HELD_AT_MOST:
        done.send(f"the data limit does not bind here: {taken} bytes allocated above it")
        return
    room = vm_data() + ROOM
    resource.setrlimit(resource.RLIMIT_DATA, (room, room))
    try:
        torch.empty(big.stat().st_size // 4)  # the limit binds: the file's size in memory is refused
        done.send(f"the data limit let the route file's size be allocated ({taken} bytes of free heap taken first)")
        return
    except RuntimeError:
        pass
    handle.teacher = teacher(big)
    assert handle.teacher.top_m == EXPERTS and handle.teacher.routes_loss == "bucket"
    done.send([step(b) for b in batches[1:]])


def test_a_route_file_larger_than_the_data_limit_trains(save_tiny, tmp_path):
    model_dir = save_tiny("moonlight", n_routed_experts=EXPERTS)
    data = write_jsonl(conversations(48, seed=5), tmp_path / "train.jsonl")
    small, big = tmp_path / "small.safetensors", tmp_path / "big.safetensors"
    write_routes(str(model_dir), data, small, MAX_LEN, probs_transform="softmax")
    write_routes(str(model_dir), data, big, MAX_LEN, probs_transform="softmax", top_m=EXPERTS)
    assert big.stat().st_size > 2 * ROOM, big.stat().st_size
    ctx = multiprocessing.get_context("fork")
    ours, theirs = ctx.Pipe()
    child = ctx.Process(target=train_two_steps_under_the_limit, args=(model_dir, data, small, big, theirs))
    child.start()
    child.join(120)
    if child.is_alive():  # a child stuck past its time is ended, so that the test fails rather than waits
        child.kill()
        child.join()
    got = ours.recv() if ours.poll() else f"the child ended with {child.exitcode} and said nothing"
    assert isinstance(got, list) and len(got) == 2 and all(t > 0 for t in got), got
