"""Training only the chosen experts (rpb.experts.masks), by LoRA and by full fine-tuning: every other expert's
weights stay bit-identical with weight decay on."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file
from transformers import TrainingArguments

from rpb.adapters import find_moe_layers, get_adapter, router_output
from rpb.anchors import AnchorConfig, install_anchor
from rpb.errors import ArgumentError
from rpb.experts import ExpertChoice, train_only_experts
from rpb.monitor import audit
from rpb.prior import SPAN_A
from rpb.testing.models import build_tiny_model
from rpb.train.config import load_config
from rpb.train.lora import LoraSection, apply_lora
from rpb.train.run import run_training
from rpb.train.trainer import AnchorTrainer
from tests.fixed_routing import MOE_LAYERS, E

pytestmark = pytest.mark.usefixtures("one_thread")


CHOSEN = {1: [0, 3], 2: [5]}


def trained(fixed, tmp_path, *extra):
    model, data, prior, _ = fixed
    path = tmp_path / "experts.json"
    path.write_text(ExpertChoice(CHOSEN).to_json())
    args = [f"model={model}", f"data_jsonl={data}", f"prior={prior}", f"output_dir={tmp_path / 'run'}",
            "anchor.method=sft", "train.max_steps=3", "train.batch_size=3", "train.lr=1e-2", "train.weight_decay=0.1",
            "train.calibrate_rows=0", *(e.format(path) for e in extra)]  # fmt: skip
    cfg = load_config(None, args)
    out = run_training(cfg, progress=False)
    return load_file(model / "model.safetensors"), load_file(out / "model.safetensors")


def per_expert(state: dict) -> dict:
    """The checkpoint's routed experts as {(layer, expert): concatenated weights}, whatever the saved layout."""
    out = {}
    for key, value in state.items():
        for layer in MOE_LAYERS:
            prefix = f"model.layers.{layer}.mlp.experts."
            if not key.startswith(prefix):
                continue
            rest = key[len(prefix) :]
            if rest[0].isdigit():  # experts.<e>.<proj>.weight
                e = int(rest.split(".")[0])
                out.setdefault((layer, e), []).append(value.reshape(-1))
            else:  # fused: gate_up_proj [E, ...]
                for e in range(value.shape[0]):
                    out.setdefault((layer, e), []).append(value[e].reshape(-1))
    return {k: torch.cat(v) for k, v in out.items()}


@pytest.mark.parametrize("how", ["full", "lora"])
def test_only_the_chosen_experts_train_and_the_rest_stay_bit_identical(fixed, tmp_path, how):
    extra = (
        ["train.only_experts={}"] if how == "full" else ["lora.rank=4", "lora.experts.from={}", "lora.attention=false"]
    )
    base, after = (per_expert(s) for s in trained(fixed, tmp_path, *extra))
    assert base.keys() == after.keys() and len(base) == len(MOE_LAYERS) * E
    for (layer, e), weights in base.items():
        moved = not torch.equal(weights, after[(layer, e)])
        assert moved == (e in CHOSEN[layer]), (how, layer, e)


# ---- masks on tiny models: biases, shared-expert gates, device and dtype, optimizers ------------------------

IDS = torch.randint(1, 64, (2, 24), generator=torch.Generator().manual_seed(0))


def selected(model, arch: str) -> dict[int, list[int]]:
    """Per MoE layer, the two highest expert ids the model's own router selects on IDS (so each gets a gradient)."""
    seen: dict[int, set] = {}

    def record(layer, output):
        seen.setdefault(layer.layer_index, set()).update(router_output(layer, output)[2].flatten().tolist())

    hooks = [m.router.register_forward_hook(lambda mod, args, out, m=m: record(m, out))
             for m in find_moe_layers(model, get_adapter(arch))]  # fmt: skip
    with torch.no_grad():
        model(input_ids=IDS)
    for h in hooks:
        h.remove()
    return {i: sorted(ids)[-2:] for i, ids in seen.items()}


def tiny(arch: str, **flags) -> tuple[torch.nn.Module, ExpertChoice]:
    model = build_tiny_model(arch, vocab_size=64).train()
    return model, ExpertChoice(selected(model, arch), **flags)


def adamw_steps(model, mask=None, steps=1, weight_decay=0.1) -> dict[str, torch.Tensor]:
    """``steps`` AdamW steps on IDS (lr 1e-2); returns every parameter's first gradient. A mask that does not
    follow the gradient fails the backward: reported as a test failure."""
    optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-2,
                                  weight_decay=weight_decay)  # fmt: skip
    if mask is not None:
        mask.restrict_decay(optimizer)
    grads = {}
    for step in range(steps):
        optimizer.zero_grad()
        try:
            model(input_ids=IDS.to(model.device), labels=IDS.to(model.device)).loss.backward()
        except RuntimeError as e:
            pytest.fail(f"the backward through the expert masks failed: {e}")
        if step == 0:
            grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
        optimizer.step()
    return grads


def check_per_expert(before: dict, after: dict, choice: ExpertChoice, names: tuple[str, ...], moved=True) -> int:
    """Every slice [e] of the parameters whose name ends with one of ``names``: bit-identical for an unchosen
    expert, changed for a chosen one (``moved``); returns how many parameters were checked."""
    checked = 0
    for name, old in before.items():
        if not name.endswith(names):
            continue
        layer = int(name.split("layers.")[1].split(".")[0])
        for e in range(old.shape[0]):
            changed = not torch.equal(old[e], after[name][e])
            assert changed == (moved and e in choice.experts.get(layer, [])), (name, e)
        checked += 1
    return checked


@pytest.mark.parametrize("non_expert_modules", [False, True])
def test_gpt_oss_per_expert_biases_follow_the_expert_mask(non_expert_modules):
    model, choice = tiny("gpt_oss", non_expert_modules=non_expert_modules)
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    mask = train_only_experts(model, choice, get_adapter("gpt_oss"))
    adamw_steps(model, mask, steps=2)
    after = dict(model.named_parameters())
    # biases [E, out] and weights [E, ...] alike: the chosen experts' slices move, the others' stay, whatever
    # non_expert_modules says
    assert check_per_expert(before, after, choice, ("gate_up_proj_bias", "down_proj_bias")) == 2 * len(choice.experts)
    assert check_per_expert(before, after, choice, ("gate_up_proj", "down_proj")) == 2 * len(choice.experts)
    router = "model.layers.0.mlp.router.bias"
    assert (not torch.equal(before[router], after[router])) == non_expert_modules


@pytest.mark.parametrize(("shared", "non_expert"), [(True, False), (False, True)])
def test_qwen2_moe_shared_expert_gate_follows_shared_experts(shared, non_expert):
    model, choice = tiny("qwen2_moe", shared_experts=shared, non_expert_modules=non_expert)
    train_only_experts(model, choice, get_adapter("qwen2_moe"))
    trainable = {n for n, p in model.named_parameters() if p.requires_grad}
    for i in choice.experts:
        for part in ("shared_expert_gate.weight", "shared_expert.gate_proj.weight"):
            assert (f"model.layers.{i}.mlp.{part}" in trainable) == shared, part
        assert (f"model.layers.{i}.mlp.gate.weight" in trainable) == non_expert


@pytest.mark.parametrize("how", ["full", "lora"])
def test_masks_follow_a_dtype_cast_after_they_are_installed(tmp_path, how):
    model, choice = tiny("qwen3_moe")
    facts = get_adapter("qwen3_moe")
    mask = None
    if how == "full":
        mask = train_only_experts(model, choice, facts)
    else:
        path = tmp_path / "experts.json"
        path.write_text(choice.to_json())
        model = apply_lora(model, LoraSection(rank=4, attention=False, experts={"from": str(path)}), facts)
    model.to(torch.bfloat16)  # after the masks, as the Trainer casts and moves after rpb installs them
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    adamw_steps(model, mask)
    after = dict(model.named_parameters())
    if how == "full":
        assert check_per_expert(before, after, choice, ("experts.gate_up_proj", "experts.down_proj")) == 4
    else:  # lora_B [out, r * E] starts at 0: expert e's columns c % E == e move in the first step if chosen
        checked = 0
        for name, old in before.items():
            if "lora_B" in name and "experts" in name:
                layer = int(name.split("layers.")[1].split(".")[0])
                for e in range(E):
                    moved = not torch.equal(old[:, e::E], after[name][:, e::E])
                    assert moved == (e in choice.experts[layer]), (name, e)
                checked += 1
        assert checked == 2 * len(choice.experts)


def test_masks_follow_their_parameters_to_the_meta_device_and_back():
    model, choice = tiny("qwen3_moe")
    mask = train_only_experts(model, choice, get_adapter("qwen3_moe"))
    buffers = {n: b.clone() for n, b in model.named_buffers()}
    weights = {n: p.detach().clone() for n, p in model.named_parameters()}
    model.set_experts_implementation("batched_mm")  # the expert kernel that runs on meta tensors
    model.to("meta")  # a move that replaces the parameters: the masks go with the new ones
    ids = IDS.to("meta")
    try:
        model(input_ids=ids, labels=ids).loss.backward()
    except RuntimeError as e:
        pytest.fail(f"a mask did not follow its parameter to the meta device: {e}")
    partly = [p for p, keep in mask.entries if not keep.all()]
    assert partly and all(p.device.type == "meta" and p.grad is not None for p in partly)
    model.to_empty(device="cpu")  # and back, replaced once more
    with torch.no_grad():
        for n, t in [*model.named_parameters(), *model.named_buffers()]:
            t.copy_(weights[n] if n in weights else buffers[n])
    model.zero_grad(set_to_none=True)
    grads = adamw_steps(model)
    for name, g in grads.items():
        if name.endswith(("experts.gate_up_proj", "experts.down_proj")):
            layer = int(name.split("layers.")[1].split(".")[0])
            for e in range(E):
                assert bool(g[e].abs().sum() > 0) == (e in choice.experts[layer]), (name, e)


def expert_trainer(tmp_path, weight_decay=0.5) -> AnchorTrainer:
    model, choice = tiny("qwen3_moe")
    mask = train_only_experts(model, choice, get_adapter("qwen3_moe"))
    args = TrainingArguments(output_dir=str(tmp_path / "out"), max_steps=2, per_device_train_batch_size=4,
                             learning_rate=1e-2, weight_decay=weight_decay, report_to=[], save_strategy="no",
                             use_cpu=True, disable_tqdm=True, remove_unused_columns=False)  # fmt: skip
    handle = install_anchor(model, AnchorConfig(method="sft"))
    return AnchorTrainer(model=model, args=args, train_dataset=Rows(), anchor=handle, expert_mask=mask)


class Rows(torch.utils.data.Dataset):
    """Rows of IDS's tokens, each its own sample, every token an answer token."""

    def __len__(self):
        return 8

    def __getitem__(self, i):
        ids = IDS[i % 2].roll(i)
        return {"input_ids": ids, "labels": ids, "attention_mask": torch.ones_like(ids),
                "rpb_sample_index": torch.full_like(ids, i), "rpb_span": torch.full_like(ids, SPAN_A)}  # fmt: skip


def test_an_audit_leaves_the_expert_mask_as_it_found_it(tmp_path):
    alone, audited = expert_trainer(tmp_path / "a"), expert_trainer(tmp_path / "b")
    start = {n: p.detach().clone() for n, p in alone.model.named_parameters()}
    audit(audited)
    alone.train()
    audited.train()
    experts = {n: p for n, p in alone.model.named_parameters() if ".experts." in n}
    assert any(not torch.equal(p, start[n]) for n, p in experts.items())  # the chosen experts trained (decay 0.5)
    for name, p in audited.model.named_parameters():
        if ".experts." in name:
            assert torch.equal(p, experts[name]), name  # no second decay left behind by the audit's optimizer


def test_experts_kept_one_module_each_follow_the_choice_and_an_unsplittable_parameter_is_refused():
    model, _ = tiny("qwen3_moe")
    for i in MOE_LAYERS:  # a layout of one module per expert, as older checkpoints and remote code keep it
        model.model.layers[i].mlp.experts = torch.nn.ModuleList(torch.nn.Linear(2, 2) for _ in range(E))
    choice = ExpertChoice({1: [3], 2: [0, 7]})
    train_only_experts(model, choice, get_adapter("qwen3_moe"))
    for i in MOE_LAYERS:
        for e in range(E):
            for p in model.model.layers[i].mlp.experts[e].parameters():
                assert p.requires_grad == (e in choice.experts[i]), (i, e)
    model.model.layers[1].mlp.experts.register_parameter("scale", torch.nn.Parameter(torch.ones(3)))
    with pytest.raises(ArgumentError, match=r"layers\.1\.mlp\.experts\.scale \(3,\): among the routed experts"):
        train_only_experts(model, choice, get_adapter("qwen3_moe"))


def test_the_gpu_smoke_script_runs_its_checks_on_the_cpu_and_refuses_a_missing_gpu(capsys):
    path = Path(__file__).resolve().parents[2] / "examples" / "hf" / "gpu_smoke.py"
    spec = importlib.util.spec_from_file_location("hf_gpu_smoke", path)
    smoke = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(smoke)
    assert smoke.main(["--device", "cpu", "--families", "gpt_oss"]) == 0
    last = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert last["ok"] and {(c["how"], c["dtype"]) for c in last["cases"] if c["ok"]} == {
        (how, dtype) for how in ("full", "lora") for dtype in ("float32", "bfloat16")
    }
    if not torch.cuda.is_available():
        assert smoke.main([]) == 2
        out, err = capsys.readouterr()
        assert json.loads(out.strip().splitlines()[-1]) == {
            "ok": False, "device": "cuda", "reason": "no CUDA device", "cases": []
        }  # fmt: skip
        assert "no CUDA device" in err and "--device cpu" in err
