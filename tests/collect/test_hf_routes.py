"""``rpb routes``: an HF model's routes in vLLM's exact layout, and the engine's requests file."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch

from rpb.adapters import find_moe_layers, get_adapter
from rpb.cli import main
from rpb.collect.hf_routes import hf_routes, vllm_dtype
from rpb.data import load_labelled
from rpb.models import load_causal_lm, load_tokenizer, pad_id_of
from rpb.replay.routefile import load_routes
from rpb.testing.data import conversations, write_jsonl

pytestmark = pytest.mark.usefixtures("one_thread")
MAX_LEN = 256


def test_vllm_id_types():
    # routed_experts_capturer.py:84: uint8 while every id fits, else uint16
    assert vllm_dtype(256) == np.uint8 and vllm_dtype(257) == np.uint16


def test_routes_are_the_routers_own_choices_laid_out_per_decoder_layer(replica, tmp_path):
    """Batched and right-padded, each row's routes are its tokens' own top-k from an
    unpadded forward (the router's returned ids), at each MoE layer's decoder-layer index; dense layers are 0."""
    model_dir = replica("deepseek_v3")
    data = write_jsonl(conversations(4, seed=8), tmp_path / "rows.jsonl")
    tokenizer = load_tokenizer(str(model_dir))
    examples = load_labelled(str(data), tokenizer, MAX_LEN).examples
    model = load_causal_lm(str(model_dir)).eval()
    routes, fingerprint = hf_routes(model, examples, pad_id_of(tokenizer), batch_size=3)
    layers = find_moe_layers(model, get_adapter(model.config.model_type))
    seen = {}
    hooks = [m.router.register_forward_hook(lambda mod, a, out, i=m.layer_index: seen.__setitem__(i, out[2]))
             for m in layers]  # fmt: skip
    for ex, got in zip(examples, routes, strict=True):
        assert got.dtype == np.uint8 and got.shape == (
            len(ex),
            model.config.num_hidden_layers,
            model.config.num_experts_per_tok,
        )
        with torch.no_grad():
            model(input_ids=torch.tensor([ex.input_ids]))
        for i in range(model.config.num_hidden_layers):
            if i in seen:
                own = seen[i].sort(dim=-1).values.numpy()
                assert (np.sort(got[:, i].astype(np.int64), axis=-1) == own).all()
            else:
                assert not got[:, i].any()  # a dense layer keeps vLLM's zeros
    for h in hooks:
        h.remove()
    assert len(fingerprint) == 64


def test_the_command_line_writes_routes_and_requests(replica, tmp_path, capsys):
    model_dir = replica("deepseek_v3")
    data = write_jsonl(conversations(3, seed=9), tmp_path / "rows.jsonl")
    common = ["routes", "--model", str(model_dir), "--data-jsonl", str(data), "--max-seq-len", str(MAX_LEN)]
    assert main([*common, "--requests", str(tmp_path / "requests.jsonl")]) == 0
    requests = [json.loads(line) for line in (tmp_path / "requests.jsonl").read_text().splitlines()]
    examples = load_labelled(str(data), load_tokenizer(str(model_dir)), MAX_LEN).examples
    assert requests == [{"row": e.index, "prompt_token_ids": e.input_ids} for e in examples]
    assert main([*common, "--out", str(tmp_path / "routes.safetensors")]) == 0
    rf = load_routes(tmp_path / "routes.safetensors")
    assert [rf.tokens(i) for i in range(rf.num_rows)] == [r["prompt_token_ids"] for r in requests]
    assert rf.metadata["model"] == str(model_dir) and "vLLM layout" in rf.metadata["engine"]
    assert main(common) != 0
    assert "needs --out" in capsys.readouterr().err


def test_with_probs_stores_the_routers_probabilities_at_the_routed_experts(replica, tmp_path, capsys):
    """--with-probs alone reads the family's own transform (DeepSeek-V3: the normalised sigmoid): each stored
    probability is that transform of the router's own logits at the expert it routed to, dense layers' columns 0."""
    model_dir = replica("deepseek_v3")
    data = write_jsonl(conversations(2, seed=9), tmp_path / "rows.jsonl")
    out = tmp_path / "routes.safetensors"
    args = ["routes", "--model", str(model_dir), "--data-jsonl", str(data), "--max-seq-len", str(MAX_LEN)]
    assert main([*args, "--out", str(out), "--with-probs"]) == 0
    assert "the family's own transform" in capsys.readouterr().out
    rf = load_routes(out)
    assert rf.metadata["probs_transform"] == "sigmoid-normalized" and rf.probs_RXK.shape == rf.routes_RXK.shape
    model = load_causal_lm(str(model_dir)).eval()
    facts = get_adapter(model.config.model_type)
    layers = find_moe_layers(model, facts)
    seen = {}
    hooks = [m.router.register_forward_hook(lambda mod, a, o, p=p: seen.__setitem__(p, o[0].detach()))
             for p, m in enumerate(layers)]  # fmt: skip
    ids = torch.tensor([rf.tokens(0)])
    with torch.no_grad():
        model(input_ids=ids)
    for h in hooks:
        h.remove()
    routes, probs = rf.routes(0), rf.probs(0)
    for pos, m in enumerate(layers):
        s = torch.sigmoid(seen[pos].double().reshape(ids.shape[1], -1))
        want = (s / s.sum(-1, keepdim=True)).gather(-1, routes[:, m.layer_index].long())
        torch.testing.assert_close(probs[:, m.layer_index].double(), want, rtol=1e-4, atol=1e-6)
    dense = [i for i in range(rf.routes_RXK.shape[1]) if i not in {m.layer_index for m in layers}]
    assert all(float(probs[:, i].abs().sum()) == 0 for i in dense)
    # --top-m: the routed k, then the likeliest of the others; bounds and its need of --with-probs refused by name
    E, K = int(layers[0].router.weight.shape[0]), routes.shape[-1]
    assert main([*args, "--out", str(out), "--with-probs", "--top-m", str(K + 2)]) == 0
    assert f"at the top {K + 2} experts" in capsys.readouterr().out
    extra_ids, extra_probs = load_routes(out).extra(0)
    for pos, m in enumerate(layers):
        s = torch.sigmoid(seen[pos].double().reshape(ids.shape[1], -1))
        p_TE = (s / s.sum(-1, keepdim=True)).scatter(-1, routes[:, m.layer_index].long(), -1.0)
        want = p_TE.topk(2, dim=-1)
        assert torch.equal(extra_ids[:, m.layer_index].long(), want.indices)
        torch.testing.assert_close(extra_probs[:, m.layer_index].double(), want.values, rtol=1e-4, atol=1e-6)
    for bad, says in ((K - 1, f"runs from {K} to {E}"), (E + 1, f"runs from {K} to {E}")):
        assert main([*args, "--out", str(tmp_path / "x"), "--with-probs", "--top-m", str(bad)]) != 0
        assert says in capsys.readouterr().err
    assert main([*args, "--out", str(tmp_path / "x"), "--top-m", str(K)]) != 0
    assert "it goes with --with-probs" in capsys.readouterr().err and not (tmp_path / "x").exists()
