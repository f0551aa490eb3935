"""Run by tests/train/test_run_distributed.py under torchrun, once for its three checks (one launch: each costs the
ranks' start-up): for ``rpb`` and ``kl-to-base``, install the anchor, shard with FSDP2, one step, and rank 0 writes
the loss, the anchor term and the full router gradients to OUT/<method>.safetensors; then the routing monitor built
on a sharded model, the routers moved, one forward of each rank's rows, and rank 0 writes its figures to
OUT/monitor.json. Every rank leaves with os._exit, because gloo's teardown can abort a finished process.
"""

import json
import os
import sys

import torch
import torch.distributed as dist
from safetensors.torch import save_file
from torch.distributed.fsdp import fully_shard

from rpb.anchors import AnchorConfig, install_anchor
from rpb.testing.models import build_tiny_model


def batch():
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(0, 107, (4, 12), generator=g)
    sample = torch.arange(4)[:, None].expand(4, 12).clone()
    span = torch.tensor([-1, 0, 0, 0, 0, -1, 1, 1, 1, 1, 1, -1]).expand(4, 12).clone()
    return ids, sample, span


def perturb_routers(model):
    """Move the routers away from their installed base copies, so base-anchored terms are not 0."""
    g = torch.Generator().manual_seed(2)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("mlp.gate.weight"):
                p.add_(torch.randn(p.shape, generator=g) * 0.3)


def moved_routers(model, sharded: bool):
    """The routers moved by a fixed amount, whether their parameters are sharded (DTensors) or whole."""
    from torch.distributed.tensor import distribute_tensor

    g = torch.Generator().manual_seed(2)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("mlp.gate.weight"):
                noise = torch.randn(p.shape, generator=g) * 0.5
                p.add_(distribute_tensor(noise, p.device_mesh, p.placements) if sharded else noise)


def monitor_figures(out_path: str):
    from rpb.monitor import RoutingMonitor

    rank, world = dist.get_rank(), dist.get_world_size()
    model = build_tiny_model("moonlight", 107).train()
    for layer in model.model.layers:
        fully_shard(layer)
    fully_shard(model)
    monitor = RoutingMonitor(model).attach()  # as the Trainer's callback does: after the model is wrapped
    moved_routers(model, sharded=True)
    ids, _, span = batch()
    rows = slice(rank * 4 // world, (rank + 1) * 4 // world)
    labels = torch.where(span[rows] == 1, ids[rows], -100)
    with torch.no_grad():
        model(input_ids=ids[rows], labels=labels)
    figures = monitor.flush()
    if rank == 0:
        with open(out_path, "w") as f:
            json.dump(figures, f)


def sharded_step(method: str, out_path: str):
    rank, world = dist.get_rank(), dist.get_world_size()
    model = build_tiny_model("moonlight", 107).train()
    prior = torch.softmax(torch.randn(4, 2, 2, 8, generator=torch.Generator().manual_seed(1)) * 3, -1)
    handle = install_anchor(model, AnchorConfig.for_method(method, lambda_=0.5), prior=prior)
    perturb_routers(model)
    for layer in model.model.layers:
        fully_shard(layer)
    fully_shard(model)
    ids, sample, span = batch()
    rows = slice(rank * 4 // world, (rank + 1) * 4 // world)  # each rank its share of the global batch
    with handle.step(sample[rows], span[rows], torch.ones_like(ids[rows])):
        out = model(input_ids=ids[rows], labels=ids[rows])
        term = handle.loss()
        (out.loss + term).backward()
    loss = torch.stack([out.loss.detach(), term.detach()])
    dist.all_reduce(loss)
    grads = {n: p.grad.full_tensor() for n, p in model.named_parameters() if n.endswith("mlp.gate.weight")}
    if rank == 0:
        save_file({"loss": loss / world, **{n: g.contiguous() for n, g in grads.items()}}, out_path)


def main(out_dir: str):
    dist.init_process_group("gloo")
    for method in ("rpb", "kl-to-base"):
        sharded_step(method, os.path.join(out_dir, f"{method}.safetensors"))
    monitor_figures(os.path.join(out_dir, "monitor.json"))
    dist.barrier()
    sys.stdout.flush()
    os._exit(0)


if __name__ == "__main__":
    main(sys.argv[1])
