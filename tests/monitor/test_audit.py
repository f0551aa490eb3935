"""``rpb audit`` / ``rpb.monitor.audit``: each trap a training set-up can hold, built on a tiny model and caught;
a correct set-up passes quietly; the caller's model, trainer and random state come back as they were.

Traps: a hand-written hook moving a frozen router's expert-correction bias; an ``lbl`` whose term never
reaches the loss; the model's native load-balancing loss left on (sized against the model's own aux_loss);
LoRA on the router through ``target_parameters`` where the router was meant frozen.
"""

from __future__ import annotations

import json

import pytest
import torch
from transformers import Trainer, TrainingArguments

from rpb.adapters import find_moe_layers, get_adapter
from rpb.anchors import AnchorConfig, install_anchor
from rpb.cli import main
from rpb.collect import collect
from rpb.monitor import Asked, audit
from rpb.monitor.verdict import FROZEN_ROUTERS_NOTE
from rpb.prior import SPAN_A, STRUCTURAL
from rpb.testing.data import write_jsonl
from rpb.testing.models import build_tiny_model
from rpb.train.trainer import AnchorTrainer
from tests.conftest import qa

pytestmark = pytest.mark.usefixtures("one_thread")


class Rows(torch.utils.data.Dataset):
    """Random rows of 10 tokens, the first 3 unlabelled, with rpb's per-token keys (each row its own sample)."""

    def __init__(self, n=8, width=10, vocab=64):
        self.ids = torch.randint(1, vocab, (n, width), generator=torch.Generator().manual_seed(0))

    def __len__(self):
        return len(self.ids)

    def __getitem__(self, i):
        labels = self.ids[i].clone()
        labels[:3] = -100
        span = torch.where(labels == -100, STRUCTURAL, SPAN_A)
        return {
            "input_ids": self.ids[i],
            "labels": labels,
            "attention_mask": torch.ones_like(self.ids[i]),
            "rpb_sample_index": torch.full_like(self.ids[i], i),
            "rpb_span": span,
        }


class PlainRows(Rows):
    def __getitem__(self, i):
        row = super().__getitem__(i)
        return {k: v for k, v in row.items() if not k.startswith("rpb_")}


def arguments(tmp_path, lr=1e-2) -> TrainingArguments:
    return TrainingArguments(
        output_dir=str(tmp_path / "out"),
        max_steps=2,
        per_device_train_batch_size=4,
        learning_rate=lr,
        report_to=[],
        save_strategy="no",
        use_cpu=True,
        disable_tqdm=True,
        remove_unused_columns=False,
    )


def plain_trainer(tmp_path, model, lr=1e-2) -> Trainer:
    return Trainer(model=model, args=arguments(tmp_path, lr), train_dataset=PlainRows())


def anchored_trainer(tmp_path, model, cls=AnchorTrainer, **anchor) -> AnchorTrainer:
    handle = install_anchor(model, AnchorConfig(**anchor))
    return cls(model=model, args=arguments(tmp_path), train_dataset=Rows(), anchor=handle)


def routers(model, arch="qwen3_moe"):
    return [m.router for m in find_moe_layers(model, get_adapter(arch))]


# ---- the caller's things, left as found ---------------------------------------------------------------------


def test_the_model_trainer_and_random_state_come_back_as_they_were(tmp_path):
    model = build_tiny_model("qwen3_moe", vocab_size=64)
    trainer = plain_trainer(tmp_path, model)
    weights = {k: v.clone() for k, v in model.state_dict().items()}
    files = sorted(tmp_path.rglob("*"))
    torch.manual_seed(123)
    expected_draw = torch.rand(3)
    torch.manual_seed(123)
    report = audit(trainer)
    assert all(a.moved > 0 for a in report.layers)  # the routers did train inside the audit
    assert torch.equal(torch.rand(3), expected_draw)
    assert all(torch.equal(weights[k], v) for k, v in model.state_dict().items())
    assert all(p.grad is None for p in model.parameters()) and not model.training
    assert trainer.optimizer is None and trainer.state.global_step == 0
    assert sorted(tmp_path.rglob("*")) == files  # nothing written


# ---- trap 1: a frozen router whose expert-correction bias a hook moves ---------------------------------------


def nudge_expert_bias(module, args, output) -> None:
    """Aux-free balancing written by hand: the expert-correction bias moved at every forward."""
    with torch.no_grad():
        module.e_score_correction_bias.add_(1e-3)


def nudge_weight(module, args) -> None:
    """A frozen router's weight moved before every forward (before autograd saves it)."""
    with torch.no_grad():
        module.weight.add_(1e-3)


def frozen_deepseek(tmp_path, hook: bool, nudge=nudge_expert_bias):
    model = build_tiny_model("moonlight", vocab_size=64)  # DeepSeek-V3 routing
    for r in routers(model, "deepseek_v3"):
        r.weight.requires_grad_(False)
        if hook and nudge is nudge_weight:
            r.register_forward_pre_hook(nudge)
        elif hook:
            r.register_forward_hook(nudge)
    return plain_trainer(tmp_path, model)


def test_a_hook_moving_a_frozen_routers_expert_bias_is_caught(tmp_path):
    report = audit(frozen_deepseek(tmp_path, hook=True))
    assert report.asked.router == "frozen"  # read from requires_grad
    assert all(a.expert_bias > 0 and a.moved == 0 and a.grad == 0 for a in report.layers)
    assert len(report.contradictions) == 1 and "expert-correction bias changed" in report.contradictions[0]


def test_a_hook_moving_a_frozen_routers_weight_is_caught_and_nothing_else(tmp_path):
    """The step-2 reruns start from the same router weights: the hook's moves, which change a sigmoid family's
    loss, are not read as a native load-balancing loss."""
    report = audit(frozen_deepseek(tmp_path, hook=True, nudge=nudge_weight))
    assert report.asked == Asked("frozen", native_aux=False)
    assert report.loss["native_aux"] == 0 and all(a.moved > 0 and a.grad == 0 for a in report.layers)
    assert [c.split(" (")[0] for c in report.contradictions] == ["router frozen asked, router changed"]


def test_a_frozen_router_left_alone_passes(tmp_path):
    report = audit(frozen_deepseek(tmp_path, hook=False))
    assert report.contradictions == [] and all(a.expert_bias == 0 and a.moved == 0 for a in report.layers)


# ---- trap 2: lbl asked, its term cut off ---------------------------------------------------------------------


class DropsTheTerm(AnchorTrainer):
    """An anchored trainer whose compute_loss forgot ``handle.loss()`` (the term is computed, never added)."""

    def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
        return Trainer.compute_loss(self, model, inputs, return_outputs, num_items_in_batch)


def test_an_lbl_term_cut_off_is_caught(tmp_path):
    model = build_tiny_model("qwen3_moe", vocab_size=64)
    report = audit(anchored_trainer(tmp_path, model, DropsTheTerm, method="lbl", lbl_coef=0.5))
    assert report.anchor_reaches is False and all(a.anchor_grad == 0 for a in report.layers)
    assert report.contradictions == [
        "lbl asked, but no load-balancing gradient reached the router (its term is "
        "never added to the loss, or is detached)"
    ]


def test_lbl_wired_in_passes_with_its_gradient_on_every_router(tmp_path):
    model = build_tiny_model("qwen3_moe", vocab_size=64)
    report = audit(anchored_trainer(tmp_path, model, method="lbl", lbl_coef=0.5))
    assert report.asked == Asked("free", "lbl", native_aux=False)
    assert report.contradictions == [] and report.anchor_reaches
    assert all(a.anchor_grad > 0 and a.aux_grad == 0 and a.seen_by_anchor for a in report.layers)
    assert report.loss["anchor"] > 0


# ---- trap 3: the model's own load-balancing loss left on ------------------------------------------------------


def test_the_native_aux_loss_is_found_and_sized_as_the_model_computes_it(tmp_path):
    model = build_tiny_model("qwen3_moe", vocab_size=64, output_router_logits=True, router_aux_loss_coef=0.5)
    report = audit(plain_trainer(tmp_path, model, lr=0.0))  # lr 0: step 2 runs on the weights below
    batch = {k: torch.stack([PlainRows()[i][k] for i in range(4)]) for k in ("input_ids", "labels", "attention_mask")}
    model.train()
    with torch.no_grad():
        out = model(**batch, output_router_logits=True)
    assert report.loss["native_aux"] == pytest.approx(0.5 * float(out.aux_loss), rel=1e-5)
    assert report.loss["lm"] == pytest.approx(float(out.loss) - 0.5 * float(out.aux_loss), rel=1e-5)
    assert all(a.aux_grad > 0 for a in report.layers)
    assert report.contradictions == []  # a plain trainer asks for nothing about it: reported only
    asked = audit(plain_trainer(tmp_path, model, lr=0.0), Asked(native_aux=False))
    assert len(asked.contradictions) == 1 and "the model's own is in the loss" in asked.contradictions[0]


def test_a_native_aux_loss_turned_back_on_after_the_anchor_is_caught(tmp_path):
    """TRL, built after the anchor was installed, sets ``output_router_logits`` from its own coefficient."""
    model = build_tiny_model("qwen3_moe", vocab_size=64, router_aux_loss_coef=0.5)
    trainer = anchored_trainer(tmp_path, model, method="sft")
    assert audit(trainer).contradictions == []
    model.config.output_router_logits = True
    report = audit(trainer)
    assert report.asked.native_aux is False and report.loss["native_aux"] > 0
    assert len(report.contradictions) == 1 and "the model's own is in the loss" in report.contradictions[0]


class AddsTheNativeLoss(Trainer):
    """A trainer asking the model for its router logits at every forward: the native loss joins the loss the
    model's config turned off."""

    def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
        return super().compute_loss(model, {**inputs, "output_router_logits": True}, return_outputs, num_items_in_batch)


def test_a_native_aux_loss_the_models_config_turns_off_is_caught_without_being_told(tmp_path):
    model = build_tiny_model("qwen3_moe", vocab_size=64, router_aux_loss_coef=0.5)  # output_router_logits off
    report = audit(AddsTheNativeLoss(model=model, args=arguments(tmp_path), train_dataset=PlainRows()))
    assert report.asked.native_aux is False and report.loss["native_aux"] > 0
    assert len(report.contradictions) == 1 and "the model's own is in the loss" in report.contradictions[0]


# ---- trap 4: LoRA reaching a router meant to stay frozen ------------------------------------------------------


def lora_trainer(tmp_path, router: str):
    from rpb.train.lora import LoraSection, apply_lora

    torch.manual_seed(0)
    model = apply_lora(
        build_tiny_model("qwen3_moe", vocab_size=64), LoraSection(rank=4, router=router), get_adapter("qwen3_moe")
    )
    return plain_trainer(tmp_path, model)


def test_lora_on_a_router_meant_frozen_is_caught(tmp_path):
    report = audit(lora_trainer(tmp_path, "lora"), Asked(router="frozen"))
    assert all(a.peft == "LoRA on its weight (target_parameters)" and a.moved > 0 for a in report.layers)
    assert [c.split(" (")[0] for c in report.contradictions] == [
        "router frozen asked, router changed",
        "router frozen asked, but PEFT wraps the router",
    ]


def test_lora_leaving_the_router_out_passes(tmp_path):
    report = audit(lora_trainer(tmp_path, "none"), Asked(router="frozen"))
    assert report.contradictions == [] and all(a.peft is None and a.moved == 0 for a in report.layers)


def test_a_router_frozen_by_hand_before_rpbs_lora_then_trained_as_a_copy_is_caught(tmp_path):
    """PEFT freezes every base weight: only rpb's record tells that the first MoE layer's router was frozen
    before the wrap made a trainable copy of it; the other layer's router, free before, trains as asked."""
    from rpb.train.lora import LoraSection, apply_lora

    torch.manual_seed(0)
    model = build_tiny_model("qwen3_moe", vocab_size=64)
    first, _ = find_moe_layers(model, get_adapter("qwen3_moe"))
    first.router.weight.requires_grad_(False)
    model = apply_lora(model, LoraSection(rank=4, router="full"), get_adapter("qwen3_moe"))
    report = audit(plain_trainer(tmp_path, model))
    assert report.asked.frozen_layers == (first.layer_index,) and all(a.moved > 0 for a in report.layers)
    assert [c.split(" (")[0] for c in report.contradictions] == [
        "router frozen asked, router changed",
        "router frozen asked, but PEFT wraps the router",
    ]
    assert all(f"(MoE layer {first.layer_index}:" in c for c in report.contradictions)  # the other is not named


# ---- the CLI on rpb train configurations ----------------------------------------------------------------------


@pytest.fixture(scope="module")
def run_files(save_tiny, tmp_path_factory):
    tmp = tmp_path_factory.mktemp("audit")
    rows = [qa(f"What is {a} + {a}?", f"{a} + {a} = {2 * a}.") for a in range(10, 18)]
    data = write_jsonl(rows, tmp / "train.jsonl")
    model = save_tiny("qwen3_moe")
    prior = tmp / "prior.safetensors"
    collect(str(model), data, prior, top_k=2, max_seq_len=128, progress=False)
    return model, data, prior


def rpb_audit(run_files, tmp_path, *extra) -> int:
    model, data, prior = run_files
    return main(
        [
            "audit",
            "--config",
            str(write_config(tmp_path)),
            f"model={model}",
            f"data_jsonl={data}",
            f"prior={prior}",
            f"output_dir={tmp_path / 'run'}",
            "train.calibrate_rows=0",
            "--report",
            str(tmp_path / "audit.json"),
            *extra,
        ]
    )


def write_config(tmp_path):
    path = tmp_path / "train.yaml"
    path.write_text("anchor:\n  method: rpb\n  beta: 4.0\ntrain:\n  batch_size: 4\n  lr: 1.0e-3\n")
    return path


def test_rpb_audit_passes_a_correct_config_and_writes_only_its_report(run_files, tmp_path, capsys):
    assert rpb_audit(run_files, tmp_path) == 0
    printed = capsys.readouterr().out
    assert "| layer | asked |" in printed and "no contradiction" in printed
    assert sorted(p.name for p in tmp_path.iterdir()) == ["audit.json", "train.yaml"]  # no run folder
    report = json.loads((tmp_path / "audit.json").read_text())
    assert report["asked"] == {"router": "free", "anchor": "rpb", "native_aux": False, "frozen_layers": []}
    assert report["notes"] == []  # the routers train: nothing to point to
    assert all(layer["seen_by_anchor"] and layer["biased"] > 0 for layer in report["layers"])


def test_rpb_audit_exits_3_on_a_contradiction(run_files, tmp_path, capsys, monkeypatch):
    """``router-freeze`` whose freeze is lost (the mutant: install_anchor leaves requires_grad on)."""
    monkeypatch.setattr(torch.Tensor, "requires_grad_", lambda self, flag=True: self)
    assert rpb_audit(run_files, tmp_path, "anchor.method=router-freeze") == 3
    assert "router frozen asked, router changed" in capsys.readouterr().out


def test_rpb_audit_passes_sft_training_only_chosen_experts(run_files, tmp_path, capsys):
    """``train.only_experts`` freezes the router (a non-expert module): no gradient reaching it is as asked."""
    choice = tmp_path / "experts.json"
    choice.write_text(json.dumps({"experts": {"1": [0, 1], "2": [2]}, "non_expert_modules": False}))
    assert rpb_audit(run_files, tmp_path, "anchor.method=sft", f"train.only_experts={choice}") == 0
    printed = capsys.readouterr().out
    assert "no contradiction" in printed
    report = json.loads((tmp_path / "audit.json").read_text())
    assert report["asked"]["router"] == "frozen"
    # no contradiction, but the question users ask most: a frozen router with nothing holding the routing
    assert report["notes"] == [FROZEN_ROUTERS_NOTE] and f"note: {FROZEN_ROUTERS_NOTE}" in printed
    assert all(layer["grad"] == 0 and layer["moved"] == 0 for layer in report["layers"])


def test_rpb_audit_runs_minimax_m2_whose_router_takes_the_blocks_bias(run_files, replica, tmp_path, capsys):
    """MiniMax-M2's router cannot be called alone: its MoE block hands it the expert-correction bias."""
    _, data, _ = run_files
    write_config(tmp_path)
    assert (
        main(
            [
                "audit",
                "--config",
                str(tmp_path / "train.yaml"),
                f"model={replica('minimax_m2')}",
                f"data_jsonl={data}",
                "anchor.method=sft",
                "train.max_seq_len=128",
                f"output_dir={tmp_path / 'run'}",
                "train.calibrate_rows=0",
                "--report",
                str(tmp_path / "audit.json"),
            ]
        )
        == 0
    )
    assert "no contradiction" in capsys.readouterr().out
    layers = json.loads((tmp_path / "audit.json").read_text())["layers"]
    assert len(layers) == 2 and all(a["grad"] > 0 and a["moved"] > 0 and a["expert_bias"] == 0 for a in layers)


# ---- a working anchor is never called broken -----------------------------------------------------------------


@pytest.fixture(scope="module")
def small_lr_files(save_tiny, tmp_path_factory):
    from rpb.testing.data import conversations

    tmp = tmp_path_factory.mktemp("small-lr")
    return {arch: save_tiny(arch) for arch in ("qwen3_moe", "moonlight")}, write_jsonl(
        conversations(8, 3), tmp / "d.jsonl"
    )


@pytest.mark.parametrize("lr", ["1.0e-5", "1.0e-6", "1.0e-7"])
@pytest.mark.parametrize("arch", ["qwen3_moe", "moonlight"])
def test_a_working_kl_to_base_at_the_docs_lambda_is_no_contradiction_in_sft(arch, lr, small_lr_files, tmp_path):
    """docs' lambda 0.1, one step from the base at a small learning rate: the anchor's gradient is a millionth of
    the LM's or less, yet it reaches the router (the audit asks with its coefficient scaled up)."""
    from rpb.train.audit import run_audit

    models, data = small_lr_files
    report = run_audit(None, [f"model={models[arch]}", f"data_jsonl={data}", f"output_dir={tmp_path / 'run'}",
                              "train.calibrate_rows=0", "train.batch_size=4", "train.max_seq_len=256",
                              "anchor.method=kl-to-base", "anchor.lambda=0.1", f"train.lr={lr}"])  # fmt: skip
    assert report.contradictions == [] and report.anchor_reaches
    assert all(layer.anchor_grad > 0 for layer in report.layers)  # small, and there


@pytest.mark.parametrize("lr", [1e-6, 1e-7])
@pytest.mark.parametrize("arch", ["qwen3_moe", "moonlight"])
def test_a_working_kl_to_base_at_the_docs_lambda_is_no_contradiction_in_grpo(arch, lr, tmp_path):
    import datasets

    from rpb.integrations.trl import GRPOTrainer
    from rpb.testing.tokenizers import moonlight_tokenizer
    from tests.integrations.trl.test_grpo import grpo_args, reward

    tok = moonlight_tokenizer()
    tok.padding_side = "left"
    model = build_tiny_model(arch, len(tok), seed=0).train()
    anchor = install_anchor(model, AnchorConfig(method="kl-to-base", lambda_=0.1))
    data = datasets.Dataset.from_list([{"prompt": p} for p in ("abc def", "hello wor", "one two", "xyz")])
    trainer = GRPOTrainer(model, reward, grpo_args(tmp_path, learning_rate=lr), data, processing_class=tok,
                          anchor=anchor)  # fmt: skip
    report = audit(trainer)
    assert report.contradictions == [] and report.anchor_reaches
    anchor.remove()
    trainer.replay.remove()


def test_a_detached_term_still_reaches_nothing(tmp_path, monkeypatch):
    """The scaled run cannot make a detached term look attached: the same kl-to-base, its term cut from the graph."""
    from rpb.anchors.handle import AnchorHandle

    loss = AnchorHandle.loss
    monkeypatch.setattr(AnchorHandle, "loss", lambda self: loss(self).detach())
    model = build_tiny_model("qwen3_moe", 64, seed=0).train()
    report = audit(anchored_trainer(tmp_path, model, method="kl-to-base", lambda_=0.1))
    assert report.anchor_reaches is False
    assert any("its loss term reached no trainable parameter's gradient" in c for c in report.contradictions)
