"""The frequency-vs-probability comparison's pieces against hand computations."""

from __future__ import annotations

import pytest
import torch

from rpb.adapters import find_moe_layers, get_adapter
from rpb.collect import collect
from rpb.data import load_labelled
from rpb.models import load_base_model, load_tokenizer
from rpb.prior import log_prior_bias
from rpb.testing.data import conversations, write_jsonl
from rpb.toyworld.prior_kinds import disagreement, prior_tvd, table
from tests.test_routing import reference_route

pytestmark = pytest.mark.usefixtures("one_thread")


def test_tvd_is_half_the_l1_distance_averaged_over_rows_and_spans():
    p = torch.tensor([[[[0.5, 0.5, 0.0]], [[1.0, 0.0, 0.0]]]])  # [N=1, S=2, L=1, E=3]
    f = torch.tensor([[[[0.5, 0.0, 0.5]], [[1.0, 0.0, 0.0]]]])
    assert prior_tvd(p, f).tolist() == pytest.approx([(0.5 + 0.0) / 2])


def test_disagreement_is_the_share_of_tokens_a_forced_expert_changes(replica, tmp_path):
    """One bias forces an expert into every top-k: the tokens that disagree are those whose own choice (the
    family's hand-written rule on the router's logits) lacks it; equal biases never disagree."""
    model_dir = replica("qwen3_30b_a3b")
    data = write_jsonl(conversations(3, seed=4), tmp_path / "rows.jsonl")
    prior = collect(str(model_dir), data, tmp_path / "p.safetensors", top_k=8, max_seq_len=512, progress=False)
    bias = log_prior_bias(prior.prior_qa)
    forced = torch.zeros_like(bias)
    e = int(prior.prior_qa[:, :, 0].mean(dim=(0, 1)).argmax())  # the first MoE layer's most used expert
    forced[..., 0, e] += 30.0  # past every logit gap: forced into each top-k (the others keep their order)
    rows = [0, 1, 2]
    assert disagreement(str(model_dir), data, 512, rows, bias, bias.clone(), (1.0,)) == {"1": [0.0] * bias.shape[2]}
    got = disagreement(str(model_dir), data, 512, rows, torch.zeros_like(bias), forced, (1.0,))["1"]
    model, _ = load_base_model(str(model_dir))
    layer = find_moe_layers(model, get_adapter(model.config.model_type))[0]
    seen = {}
    hook = layer.router.register_forward_hook(lambda m, a, out: seen.__setitem__("z", out[0]))
    lacking = total = 0
    for ex in load_labelled(str(data), load_tokenizer(str(model_dir)), 512).examples:
        with torch.no_grad():
            model(input_ids=torch.tensor([ex.input_ids]))
        content = torch.tensor(ex.span_ids) >= 0
        z = seen["z"][content].float()
        ids, _ = reference_route(layer.router, z, torch.zeros_like(z))
        lacking += int((ids != e).all(dim=-1).sum())
        total += int(content.sum())
    hook.remove()
    assert got[0] == pytest.approx(lacking / total) and 0 < got[0] < 1
    assert got[1:] == [0.0] * (len(got) - 1)  # the other layers' biases are equal


def test_the_table_has_one_row_per_base_set_and_layer():
    c = {"base": 2, "set": "math_post", "moe_layers": [1, 3], "tvd": [0.25, 0.5],
         "clipped_share": {"probability": [0.0, 0.01], "frequency": [0.6, 0.62]},
         "displacement": {"probability": {"0.25": [0.3, 0.4], "1": [0.8, 0.9]},
                          "frequency": {"0.25": [0.35, 0.45], "1": [0.7, 0.75]}},
         "disagreement": {"0.25": [0.2, 0.3], "1": [0.5, 0.6]}}  # fmt: skip
    lines = table([c]).splitlines()
    assert len(lines) == 4
    assert lines[3] == "| 2 | math_post | 3 | 0.500 | 1% / 62% | 40% / 45% | 90% / 75% | 30% / 60% |"
