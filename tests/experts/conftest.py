"""The experts tests' shared model: Qwen3-MoE whose routing is fixed by hand, its data and prior."""

import pytest

from rpb.collect import collect
from tests.conftest import qa, write_rows
from tests.fixed_routing import ROWS, K, save_fixed_routing


@pytest.fixture(scope="package")
def fixed(tmp_path_factory, moon_tok):
    tmp = tmp_path_factory.mktemp("experts")
    data = write_rows(tmp / "data.jsonl", [qa(q, a) for q, a in ROWS])
    model = save_fixed_routing(tmp / "base", "base", moon_tok)
    prior = tmp / "prior.safetensors"
    collect(str(model), data, prior, top_k=K, max_seq_len=128, progress=False)
    return model, data, prior, moon_tok
