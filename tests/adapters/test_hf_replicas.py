"""Real checkpoints' configs, as they ship: tiny replicas of each (``rpb.testing.replicas``) keep every routing
value of the vendored ``config.json``, and go end to end through rpb -- collect, the anchor's selection
against the family's hand-written rule, calibrate, train (``rpb`` and ``kl-to-base``, 2 steps) and
retention."""

from __future__ import annotations

import json
import re

import pytest
import torch

from rpb.anchors import AnchorConfig, install_anchor
from rpb.calibrate import calibrate
from rpb.collect import collect
from rpb.data import AnchorCollator, load_labelled
from rpb.models import load_causal_lm, load_tokenizer
from rpb.prior.artifact import load_artifact
from rpb.retention.run import run_retention
from rpb.testing.data import conversations, write_jsonl
from rpb.testing.replicas import (
    REPLICAS,
    ROUTING_KEYS,
    moe_layer_count,
    published,
    routing_part,
    source,
)
from rpb.train.config import load_config
from rpb.train.run import run_training
from tests.conftest import coefficient_overrides
from tests.hand_routing import token_bias
from tests.test_routing import reference_route

pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.mark.parametrize("name", REPLICAS)
def test_each_replica_keeps_the_published_routing_values(name, replica):
    from transformers import AutoConfig

    from rpb.adapters.aliases import register_model_aliases

    register_model_aliases()
    # read back as the class reads it (transformers 5 renames some keys: Qwen3-MoE's num_experts, say)
    whole = AutoConfig.from_pretrained(str(replica(name)))
    assert whole.model_type == published(name)["model_type"]
    real, built = routing_part(published(name)), whole.get_text_config()
    where = source(name)
    assert re.fullmatch(r"[0-9a-f]{40}", where["commit"]) and where["repository"].count("/") == 1 and where["path"]
    kept = [k for k in ROUTING_KEYS if k in real]
    assert {"model_type", "num_experts_per_tok"} <= set(kept)
    assert {k: getattr(built, k) for k in kept} == {k: real[k] for k in kept}
    moe = built.num_hidden_layers - int(real.get("first_k_dense_replace") or 0)
    assert moe == moe_layer_count(name) >= 2 and built.hidden_size < real["hidden_size"]


def test_each_vendored_config_is_the_published_file():
    """The bytes of every vendored config.json are the Hugging Face file's: its sha256 as recorded at the named
    revision (the copies that lack the HF file's final newline are named so)."""
    import hashlib

    from rpb.testing.replicas import CONFIGS as FIXTURES

    sources = json.loads((FIXTURES / "SOURCES.json").read_text())
    assert sorted(sources) == sorted(p.name for p in FIXTURES.glob("*.json") if p.name != "SOURCES.json")
    assert {f"{name}.json" for name in REPLICAS} == set(sources)
    for name, where in sources.items():
        data = (FIXTURES / name).read_bytes()
        hf = where.get("hf")
        if hf is None:  # Kimi-K2: no record of the HF file's hash; its two GitHub copies agree (SOURCES.json)
            assert name == "kimi_k2.json"
            continue
        if hf["bytes"] != "identical":
            data += b"\n"
        assert hashlib.sha256(data).hexdigest() == hf["sha256"], name
        assert re.fullmatch(r"[0-9a-f]{40}", hf["revision"]) and where["checkpoint"] == hf["repository"]


def routers_of(model) -> list[torch.nn.Module]:
    return [m for m in model.modules() if type(m).__name__.endswith(("TopkRouter", "TopKRouter"))]


def check_selection_against_the_hand_rule(model_dir, data, prior) -> int:
    """One anchored training forward (beta 1): every content token's experts are the family's hand-written
    selection on logits + eq. 3's bias; returns the number of tokens whose choice the bias changed."""
    model = load_causal_lm(str(model_dir)).train()
    rows = load_labelled(str(data), load_tokenizer(str(model_dir)), 512).examples[:4]
    batch = AnchorCollator(pad_id=0)(
        [
            {"input_ids": e.input_ids, "labels": e.input_ids, "span_ids": e.span_ids, "sample_index": e.index}
            for e in rows
        ]
    )
    pi = load_artifact(prior).prior_qa
    handle = install_anchor(model, AnchorConfig(method="rpb", beta=1.0), prior=pi)
    seen = []
    routers = routers_of(model)
    # a MiniMax-M2 router's second argument is its block's expert-correction bias
    hooks = [r.register_forward_hook(lambda m, a, out: seen.append((out[0].detach(), out[2], a[1:]))) for r in routers]
    with handle.step(batch["rpb_sample_index"], batch["rpb_span"], batch["attention_mask"]), torch.no_grad():
        model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"])
    for h in hooks:
        h.remove()
    handle.remove()
    sample_T, span_T = batch["rpb_sample_index"].reshape(-1), batch["rpb_span"].reshape(-1)
    content_T = (span_T >= 0) & (sample_T >= 0)
    changed = 0
    for layer, (router, (logits_TE, ids_TK, extra)) in enumerate(zip(routers, seen, strict=True)):
        # content tokens only: padding embeds to zero, where every expert ties
        z_CE = logits_TE[content_T]
        block_bias = extra[0] if extra else None
        bias_CE = token_bias(pi, layer, sample_T, span_T, 1.0)[content_T]
        expected_CK, _ = reference_route(router, z_CE, bias_CE, block_bias)
        native_CK, _ = reference_route(router, z_CE, torch.zeros_like(z_CE), block_bias)
        got = ids_TK[content_T].sort(-1).values
        assert torch.equal(got, expected_CK.sort(-1).values), f"layer {layer}"
        changed += int((got != native_CK.sort(-1).values).any(-1).sum())
    return changed


@pytest.mark.parametrize("name", REPLICAS)
def test_every_family_end_to_end(name, replica, tmp_path):
    model_dir = replica(name)
    data = write_jsonl(conversations(4, seed=3), tmp_path / "train.jsonl")
    prior = tmp_path / "prior.safetensors"
    top_k = routing_part(published(name))["num_experts_per_tok"]
    art = collect(str(model_dir), data, prior, top_k=top_k, max_seq_len=512, progress=False)
    assert art.prior_qa.shape[2] == moe_layer_count(name) and art.metadata["top_k"] == top_k

    assert check_selection_against_the_hand_rule(model_dir, data, prior) > 0

    report = calibrate(str(model_dir), prior, data, betas=[1.0], rows=4, progress=False)
    assert 0.0 < report["displacement_counterfactual"]["mean"]["1"]["both"] <= 1.0

    outs = {}
    for method in ("rpb", "kl-to-base"):
        cfg = load_config(
            None,
            [
                f"model={model_dir}",
                f"data_jsonl={data}",
                f"prior={prior}",
                f"output_dir={tmp_path / method}",
                f"anchor.method={method}",
                *coefficient_overrides(method, 0.1, 0.01),
                "train.max_steps=2",
                "train.batch_size=2",
                "train.calibrate_rows=0",
                "train.log_every=1",
            ],
        )
        outs[method] = run_training(cfg, progress=False)
        logs = [json.loads(x) for x in (outs[method] / "log.jsonl").read_text().splitlines()]
        assert [r["step"] for r in logs if "loss" in r] == [1, 2]

    run_retention(str(model_dir), data, tmp_path / "retention", post=str(outs["rpb"]), max_rows=4, progress=False)
    retained = json.loads((tmp_path / "retention" / "report.json").read_text())
    assert retained["moe_layers"] == art.metadata["moe_layers"]


@pytest.mark.parametrize("name", ["deepseek_v3", "kimi_k2"])
def test_a_config_naming_remote_code_loads_natively(name, replica, tmp_path):
    """DeepSeek-V3 and Kimi-K2 ship an ``auto_map`` to their own modeling code (so does Moonlight): with the
    map kept as published and no code beside it, rpb loads the native class (docs/collect.md)."""
    import shutil

    from rpb.models import load_base_model

    auto_map = published(name)["auto_map"]
    assert "AutoModelForCausalLM" in auto_map
    folder = tmp_path / "with-auto-map"
    shutil.copytree(replica(name), folder)
    config = json.loads((folder / "config.json").read_text())
    (folder / "config.json").write_text(json.dumps(config | {"auto_map": auto_map}))
    assert not list(folder.glob("*.py"))
    model = load_causal_lm(str(folder))
    base, _ = load_base_model(str(folder), device="cpu")
    from transformers.models.deepseek_v3 import DeepseekV3ForCausalLM

    assert isinstance(model, DeepseekV3ForCausalLM)  # Kimi-K2's: rpb's explicit alias of that class
    reference = load_causal_lm(str(replica(name)))
    for got, want in ((model, reference), (base, reference.model)):
        got_sd, want_sd = got.state_dict(), want.state_dict()
        assert got_sd.keys() == want_sd.keys() and all(torch.equal(got_sd[k], want_sd[k]) for k in got_sd)
