"""One gloo process group per test module (megatron's routers hold process groups), and megatron-core's
router linear without Transformer Engine (0.16.1 reads an undefined ``te_general_gemm``: None is the
plain torch path)."""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("megatron.core", reason="megatron-core is an optional extra: pip install 'rpb[megatron]'")

from megatron.core.transformer.moe import moe_utils


@pytest.fixture(scope="module", autouse=True)
def gloo(tmp_path_factory):
    """One gloo process group for the module (megatron's routers hold process groups)."""
    dist = torch.distributed
    owned = not dist.is_initialized()
    if owned:
        store = tmp_path_factory.mktemp("gloo") / "store"
        dist.init_process_group("gloo", init_method=f"file://{store}", rank=0, world_size=1)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)
    if owned:
        dist.destroy_process_group()


@pytest.fixture(autouse=True)
def router_linear_without_transformer_engine(monkeypatch):
    monkeypatch.setattr(moe_utils, "te_general_gemm", None, raising=False)
