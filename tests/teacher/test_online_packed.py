"""The online base on packed batches (``data.packing: true``): a packed row carries no attention mask, so its
examples are kept apart by their restarting ``position_ids`` alone; the base's forward must take them too, or every
example after a row's first reads the ones before it. Read against each example's own unpacked forward of the same
model (router logits by hooks of the test's own), and through ``rpb train``, whose first step trains the base
itself."""

from __future__ import annotations

import pytest
import torch

from rpb.adapters import find_moe_layers, get_adapter
from rpb.models import load_causal_lm
from rpb.teacher.online import OnlineBase
from rpb.train.run import run_training
from tests.teacher.conftest import config, log_of

pytestmark = pytest.mark.usefixtures("one_thread")
LENGTHS = (9, 13, 6)  # three examples packed into one row


def router_logits(model, layers, **inputs) -> list[torch.Tensor]:
    """Each MoE layer's router logits ([tokens, experts]) in one forward, read by hooks of the test's own."""
    seen: dict[int, torch.Tensor] = {}
    hooks = [m.router.register_forward_hook(lambda mod, a, out, p=p: seen.__setitem__(p, out[0].detach().clone()))
             for p, m in enumerate(layers)]  # fmt: skip
    try:
        with torch.no_grad():
            model(**inputs, use_cache=False)
    finally:
        for h in hooks:
            h.remove()
    return [seen[p] for p in range(len(layers))]


def test_each_packed_examples_base_routing_is_its_own_unpacked_forwards(setup):
    facts = get_adapter("deepseek_v3")
    model = load_causal_lm(str(setup[0])).eval()
    layers = find_moe_layers(model, facts)
    gen = torch.Generator().manual_seed(3)
    examples = [torch.randint(5, model.config.vocab_size, (n,), generator=gen) for n in LENGTHS]
    packed = {
        "input_ids": torch.cat(examples)[None],
        "position_ids": torch.cat([torch.arange(n) for n in LENGTHS])[None],
        "labels": torch.cat(examples)[None],  # a training batch's other keys: the base takes none of them
    }
    routing = OnlineBase("frozen-copy", facts, model).step(packed)
    own = [router_logits(model, layers, input_ids=ids[None]) for ids in examples]
    run_on = router_logits(model, layers, input_ids=packed["input_ids"])  # no positions: examples read each other
    starts = [sum(LENGTHS[:i]) for i in range(len(LENGTHS))]
    for pos in range(len(layers)):
        for i, (start, n) in enumerate(zip(starts, LENGTHS, strict=True)):
            got = routing.logits_LTE[pos][start : start + n]
            torch.testing.assert_close(got, own[i][pos], rtol=1e-5, atol=1e-5, msg=f"layer {pos}, example {i}")
            if i > 0:  # the case tells the two apart: one row without its positions routes otherwise
                assert not torch.allclose(run_on[pos][start : start + n], own[i][pos], rtol=1e-3, atol=1e-3)


def test_step_one_of_a_packed_routing_kd_run_logs_an_anchor_term_of_zero(setup, tmp_path, monkeypatch):
    """Step 1 trains the base itself: packed or not, its routing is the base's and KL is 0."""
    from rpb.data import batches

    rows: list[int] = []
    collate = batches.AnchorCollator.__call__

    def recording(self, features):
        out = collate(self, features)
        rows.extend(int((p == 0).sum()) for p in out["position_ids"])  # examples (and padding tokens) per row
        return out

    monkeypatch.setattr(batches.AnchorCollator, "__call__", recording)
    out = run_training(config(setup, tmp_path / "packed", "routing-kd", "data.packing=true", steps=1), progress=False)
    assert rows and max(rows) >= 2, "no row packed two examples: the case shows nothing"
    (term,) = [r["anchor_loss"] for r in log_of(out) if "anchor_loss" in r]
    assert term == pytest.approx(0.0, abs=1e-6)
