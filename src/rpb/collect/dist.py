"""The processes of a sharded collection: ``torchrun`` / ``accelerate launch`` environments.

Ranks only need to agree on when to start and when everyone is done (the data never
travels between them: each writes its own chunk files), so a gloo group serves on any
device, and a single process needs no group at all.
"""

from __future__ import annotations

import contextlib
import os
from dataclasses import dataclass
from datetime import timedelta

import torch.distributed as dist

#: ranks that finish their chunks wait at a barrier for the slowest one; a rank that dies is
#: the launcher's to notice (torchrun stops the others), so this only has to outlast a chunk
BARRIER_TIMEOUT = timedelta(hours=12)


@dataclass(frozen=True)
class Ranks:
    rank: int = 0
    world: int = 1
    local_rank: int = 0
    group: object = None

    @property
    def main(self) -> bool:
        return self.rank == 0

    def barrier(self) -> None:
        if self.world > 1:
            dist.barrier(group=self.group)


@contextlib.contextmanager
def ranks():
    """The launcher's process layout (WORLD_SIZE, RANK, LOCAL_RANK); a gloo group when
    WORLD_SIZE > 1, set up here and torn down at the end unless the caller made one."""
    world = int(os.environ.get("WORLD_SIZE", "1"))
    if world <= 1:
        yield Ranks()
        return
    created = not dist.is_initialized()
    if created:
        dist.init_process_group("gloo", timeout=BARRIER_TIMEOUT)
    try:
        group = None if dist.get_backend() == "gloo" else dist.new_group(backend="gloo", timeout=BARRIER_TIMEOUT)
        local = int(os.environ.get("LOCAL_RANK", dist.get_rank()))
        yield Ranks(dist.get_rank(), dist.get_world_size(), local, group)
    finally:
        if created:
            dist.destroy_process_group()
