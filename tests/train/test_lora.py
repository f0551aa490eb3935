"""LoRA with PEFT (``lora:``), on tiny DeepSeek-V3 (Moonlight) and Qwen3-MoE models, dropout 0.

References: the selection written out in ``tests/hand_routing.py`` on the logits the router
returned; eq. 5 computed by hand on base + (alpha / r) B·A with autograd for its gradient; the
routers PEFT actually runs, found here by PEFT's own attribute names; plain transformers and
PEFT loading the saved checkpoints.
"""

from __future__ import annotations

import pytest
import torch
from peft import PeftModel
from safetensors.torch import load_file
from transformers import AutoModelForCausalLM

from rpb.adapters import find_moe_layers, get_adapter
from rpb.anchors import AnchorConfig, install_anchor
from rpb.collect import collect
from rpb.data import AnchorCollator, ExampleDataset, load_labelled
from rpb.errors import ArgumentError
from rpb.models import load_tokenizer
from rpb.monitor.asked import routers_frozen_before_lora
from rpb.prior.artifact import load_artifact
from rpb.testing.data import conversations, write_jsonl
from rpb.testing.models import ARCHITECTURES, build_tiny_model
from rpb.train.config import load_config
from rpb.train.lora import LoraSection, apply_lora
from rpb.train.run import run_training
from tests.conftest import coefficient_overrides
from tests.hand_routing import hand_select, token_bias

ARCHS = ("moonlight", "qwen3_moe")
pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture(scope="module")
def setup(tmp_path_factory, save_tiny):
    tmp = tmp_path_factory.mktemp("lora")
    data = write_jsonl(conversations(12, seed=4), tmp / "train.jsonl")
    out = {}
    for arch in ARCHS:
        model = save_tiny(arch)
        prior = tmp / f"{arch}.safetensors"
        collect(str(model), data, prior, top_k=ARCHITECTURES[arch][1]["num_experts_per_tok"], max_seq_len=192,
                progress=False)  # fmt: skip
        out[arch] = (model, data, prior)
    return out


def train(setup, arch, out, method="rpb", *overrides):
    model, data, prior = setup[arch]
    cfg = load_config(None, [
        f"model={model}", f"data_jsonl={data}", f"prior={prior}", f"output_dir={out}", f"anchor.method={method}",
        *coefficient_overrides(method, 0.1, 0.01), "train.max_steps=2", "train.batch_size=4", "train.lr=1e-2",
        "train.log_every=1", "train.calibrate_rows=0", "lora.rank=4", "lora.alpha=8", *overrides,
    ])  # fmt: skip
    return run_training(cfg, progress=False)


def peft_model(setup, arch, **section):
    model = AutoModelForCausalLM.from_pretrained(setup[arch][0])
    return apply_lora(model, LoraSection(rank=4, alpha=8, **section), get_adapter(model.config.model_type))


def one_batch(setup, arch, rows=4):
    tok = load_tokenizer(str(setup[arch][0]))
    data = load_labelled(str(setup[arch][1]), tok, 192)
    ds = ExampleDataset(data.examples)
    return AnchorCollator(pad_id=tok.pad_token_id or 0)([ds[i] for i in range(rows)])


def peft_routers(model) -> list[tuple[torch.nn.Module, torch.nn.Module]]:
    """(module at the router's place, module that runs there), by PEFT's own attribute names."""
    out = []
    for name, module in model.named_modules():
        if name.endswith("mlp.gate"):
            runs = module
            if hasattr(module, "modules_to_save"):
                runs = module.modules_to_save["default"]
            elif hasattr(module, "base_layer"):
                runs = module.base_layer
            out.append((module, runs))
    return out


def step(handle, model, batch):
    """One training-mode forward and backward under the step context; returns the language-model loss."""
    inputs = {k: v for k, v in batch.items() if not k.startswith("rpb_")}
    model.train()
    with handle.step(batch["rpb_sample_index"], batch["rpb_span"], batch["attention_mask"]):
        loss = model(**inputs).loss + handle.loss()
        loss.backward()
    return loss


# ---- LoRA on attention and experts, router frozen ------------------------------------------------
@pytest.mark.parametrize("arch", ARCHS)
def test_lora_sft_is_lora_rpb_at_beta_zero_bit_for_bit(setup, arch, tmp_path):
    sft = load_file(train(setup, arch, tmp_path / "sft", "sft") / "model.safetensors")
    rpb0 = load_file(train(setup, arch, tmp_path / "rpb0", "rpb", "anchor.beta=0") / "model.safetensors")
    rpb1 = load_file(train(setup, arch, tmp_path / "rpb1", "rpb", "anchor.beta=1") / "model.safetensors")
    base = load_file(setup[arch][0] / "model.safetensors")
    assert sft.keys() == rpb0.keys() == base.keys()  # merged: plain transformers names, no LoRA tensors
    assert all(torch.equal(sft[k], rpb0[k]) for k in sft)
    assert any(not torch.equal(sft[k], base[k]) for k in sft), "LoRA trained nothing"
    assert any(not torch.equal(rpb1[k], rpb0[k]) for k in sft), "beta 1 trained exactly like beta 0"
    routers = [k for k in base if k.endswith("mlp.gate.weight")]
    assert routers and all(torch.equal(rpb1[k], base[k]) for k in routers)  # frozen router


@pytest.mark.parametrize(("arch", "router"), [(a, r) for a in ARCHS for r in ("none", "full", "lora")])
def test_selection_under_peft_equals_the_hand_selection(setup, arch, router):
    """Frozen, modules_to_save and LoRA-wrapped routers: rpb's hook fires once per MoE layer per
    forward, on the module that runs, and chooses what the hand selection chooses."""
    model = peft_model(setup, arch, router=router)
    if router == "lora":  # B = 0 at init: give the delta a value, so the effective weight differs from the base
        for wrapper, _ in peft_routers(model):
            torch.nn.init.normal_(wrapper.lora_B["default"].weight, std=0.5)
    pi = load_artifact(setup[arch][2]).prior_qa
    handle = install_anchor(model, AnchorConfig(method="rpb", beta=1.0), prior=pi, record_stats=True)
    batch = one_batch(setup, arch)
    calls, seen, originals = [], [], []

    def watch(pos):
        def hook(module, args, out):  # after rpb's hook: ``out`` is what the MoE block receives
            calls.append(pos)
            seen.append((pos, out))

        return hook

    for pos, (outer, runs) in enumerate(peft_routers(model)):
        runs.register_forward_hook(watch(pos))
        if hasattr(outer, "original_module"):
            outer.original_module.register_forward_hook(lambda *a: originals.append(1) and None)
    step(handle, model, batch)
    n = len(handle.layers)
    assert sorted(calls) == list(range(n)) and not originals and sorted(handle.stats) == list(range(n))
    k = ARCHITECTURES[arch][1]["num_experts_per_tok"]
    sample_T, span_T = batch["rpb_sample_index"].reshape(-1), batch["rpb_span"].reshape(-1)
    valid = batch["attention_mask"].reshape(-1).bool()
    for pos, (z_TE, _, ids_TK) in seen:
        runs = peft_routers(model)[pos][1]
        expected = hand_select(z_TE, token_bias(pi, pos, sample_T, span_T, 1.0), k,
                               getattr(runs, "e_score_correction_bias", None))  # fmt: skip
        chosen = [frozenset(r) for r in ids_TK.tolist()]
        assert [c for c, v in zip(chosen, valid, strict=True) if v] == [
            e for e, v in zip(expected, valid, strict=True) if v
        ]
    assert any(s.changed for s in handle.stats.values())
    handle.remove()


# ---- the loss anchors read the effective weight ---------------------------------------------------
@pytest.mark.parametrize("arch", ARCHS)
def test_router_l2_on_a_lora_router_is_eq5_on_base_plus_ba(setup, arch):
    model = peft_model(setup, arch, router="lora", attention=False, experts=False)
    base = AutoModelForCausalLM.from_pretrained(setup[arch][0]).state_dict()
    for wrapper, _ in peft_routers(model):
        torch.nn.init.normal_(wrapper.lora_B["default"].weight, std=0.5)
    handle = install_anchor(model, AnchorConfig(method="router-l2", lambda_=0.1))
    batch = one_batch(setup, arch)
    inputs = {k: v for k, v in batch.items() if not k.startswith("rpb_")}
    model.train()
    with handle.step(batch["rpb_sample_index"], batch["rpb_span"], batch["attention_mask"]):
        model(**inputs)
        term = handle.loss()
        term.backward()
    # by hand: lambda * mean over layers of ||(W + s B A) - W||^2, s = alpha / r, on copies of A and B
    wrappers = [w for w, _ in peft_routers(model)]
    names = [n for n in base if n.endswith("mlp.gate.weight")]
    factors = [(w.lora_A["default"].weight.detach().clone().requires_grad_(),
                w.lora_B["default"].weight.detach().clone().requires_grad_()) for w in wrappers]  # fmt: skip
    per_layer = [((base[n] + 2.0 * B @ A) - base[n]).pow(2).sum() for n, (A, B) in zip(names, factors, strict=True)]
    expected = 0.1 * torch.stack(per_layer).mean()
    expected.backward()
    torch.testing.assert_close(term, expected, rtol=1e-5, atol=0)
    for w, (A, B) in zip(wrappers, factors, strict=True):
        torch.testing.assert_close(w.lora_A["default"].weight.grad, A.grad, rtol=1e-4, atol=1e-7)
        torch.testing.assert_close(w.lora_B["default"].weight.grad, B.grad, rtol=1e-4, atol=1e-7)
    handle.remove()


@pytest.mark.parametrize("arch", ARCHS)
def test_router_l2_on_a_frozen_router_is_refused(setup, arch):
    model = peft_model(setup, arch, router="none")
    with pytest.raises(ArgumentError, match="no router of this model can train"):
        install_anchor(model, AnchorConfig(method="router-l2", lambda_=0.1))
    # kl-to-base still trains the layers below the router, through the hidden states
    install_anchor(model, AnchorConfig(method="kl-to-base", lambda_=0.1)).remove()


# ---- what is saved ----------------------------------------------------------------------------------
@pytest.mark.parametrize("arch", ARCHS)
def test_merged_checkpoint_loads_plain_and_matches_the_adapter(setup, arch, tmp_path):
    merged_dir = train(setup, arch, tmp_path / "merged", "rpb", "lora.router=lora")
    adapter_dir = train(setup, arch, tmp_path / "adapter", "rpb", "lora.router=lora", "lora.merge=false")
    assert (adapter_dir / "adapter_config.json").is_file() and not (adapter_dir / "model.safetensors").exists()
    merged = AutoModelForCausalLM.from_pretrained(merged_dir).eval()
    unmerged = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(setup[arch][0]), adapter_dir).eval()
    ids = one_batch(setup, arch, rows=2)
    inputs = {"input_ids": ids["input_ids"], "attention_mask": ids["attention_mask"]}
    with torch.no_grad():
        a, b = merged(**inputs).logits, unmerged(**inputs).logits
    assert (a - b).abs().max() < 1e-5
    base = load_file(setup[arch][0] / "model.safetensors")
    assert not torch.equal(load_file(merged_dir / "model.safetensors")["model.layers.1.mlp.gate.weight"],
                           base["model.layers.1.mlp.gate.weight"])  # fmt: skip


def test_the_lora_section_is_checked(setup, tmp_path):
    from rpb.errors import ConfigError

    model, data, prior = setup["qwen3_moe"]
    with pytest.raises(ConfigError) as e:
        load_config(None, [f"model={model}", f"data_jsonl={data}", f"prior={prior}", f"output_dir={tmp_path}",
                           "lora.rank=-1", "lora.router=half", "lora.dropout=1.5"])  # fmt: skip
    text = str(e.value)
    assert "lora.rank" in text and "lora.router" in text and "lora.dropout" in text


def test_apply_lora_records_the_routers_frozen_before_it_wraps():
    """PEFT freezes every router it does not wrap and makes trainable copies of those it does: only the record
    keeps which one the user had frozen; merging drops it with the wrapper."""
    facts = get_adapter("qwen3_moe")
    model = build_tiny_model("qwen3_moe", vocab_size=64)
    layers = find_moe_layers(model, facts)
    layers[1].router.weight.requires_grad_(False)
    wrapped = apply_lora(model, LoraSection(rank=4, router="full"), facts)
    assert all(m.trainable for m in find_moe_layers(wrapped, facts))
    assert routers_frozen_before_lora(wrapped) == (layers[1].layer_index,)
    assert routers_frozen_before_lora(wrapped.merge_and_unload()) is None
