"""The online base through ``rpb train`` on a tiny DeepSeek-V3 (Moonlight) model: under full fine-tuning (a frozen
copy) and under LoRA (the adapters disabled for the base forward, back on for training), output-kd against a hand
KL, and what has no base to recover, refused by name."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM, TrainerCallback

from rpb.errors import ArgumentError
from rpb.train.run import prepare_run, run_training
from tests.teacher.conftest import config, log_of

pytestmark = pytest.mark.usefixtures("one_thread")
ROOT = Path(__file__).resolve().parents[2]


def test_online_routing_kd_under_full_fine_tuning_starts_at_zero_and_records_its_copy(setup, tmp_path):
    out = run_training(config(setup, tmp_path / "run", "routing-kd"), progress=False)
    terms = [r["anchor_loss"] for r in log_of(out) if "anchor_loss" in r]
    # step 1 trains the base itself: its routing is the base's, so KL is 0; later steps have moved it
    assert terms[0] == pytest.approx(0.0, abs=1e-6) and terms[-1] > 1e-6
    base = json.loads((out / "rpb_run.json").read_text())["base"]
    assert base["source"] == "online" and base["mode"] == "frozen-copy" and base["dtype"] == "float32"
    model = AutoModelForCausalLM.from_pretrained(setup[0])
    assert base["copy_bytes"] == sum(t.numel() * t.element_size() for t in [*model.parameters(), *model.buffers()])
    (first,) = [r for r in log_of(out) if "base/copy_mib" in r]  # the log says it before the first step
    assert first["step"] == 0 and first["base/copy_mib"] == round(base["copy_bytes"] / 2**20, 3)


class AdaptersOn(TrainerCallback):
    """After every optimizer step: whether every LoRA layer of the model has its adapters on."""

    def __init__(self):
        self.seen = []

    def on_step_end(self, args, state, control, model=None, **kwargs):
        layers = [m for m in model.modules() if hasattr(m, "merged_adapters")]
        self.seen.append(bool(layers) and not any(m.disable_adapters for m in layers))


def test_under_lora_the_base_is_the_model_with_adapters_off_and_they_come_back_every_step(setup, tmp_path):
    cfg = config(setup, tmp_path / "lora", "routing-kd", "lora.rank=4", "lora.alpha=8")
    prepared = prepare_run(cfg, progress=False)
    assert prepared.handle.teacher.mode == "adapters-off" and prepared.info["base"]["copy_bytes"] == 0
    prepared.handle.remove()
    on = AdaptersOn()
    out = run_training(cfg, progress=False, callbacks=[on])
    assert on.seen == [True, True, True]
    terms = [r["anchor_loss"] for r in log_of(out) if "anchor_loss" in r]
    assert terms[0] == pytest.approx(0.0, abs=1e-6) and terms[-1] > 1e-6
    # the saved model is the merged adapters: it differs from the base, so the adapters trained (they were on
    # in the training forwards), and it computes what the run's PEFT model computed
    merged = AutoModelForCausalLM.from_pretrained(out)
    base = AutoModelForCausalLM.from_pretrained(setup[0])
    moved = [n for n, p in merged.named_parameters() if not torch.equal(p, base.get_parameter(n))]
    assert any("self_attn" in n for n in moved)


def test_a_model_trained_in_memory_and_merged_adapters_have_no_base_to_recover(setup, tmp_path):
    from rpb.adapters import get_adapter
    from rpb.teacher import online_base
    from rpb.train.lora import LoraSection, apply_lora

    model = AutoModelForCausalLM.from_pretrained(setup[0])
    facts = get_adapter(model.config.model_type)
    with torch.no_grad():
        model.model.layers[1].mlp.gate.weight.add_(0.1)
    with pytest.raises(ArgumentError, match=r"the model in memory is not the checkpoint"):
        online_base(model, facts, model_id=str(setup[0]), dtype=None, outputs=False)
    peft = apply_lora(AutoModelForCausalLM.from_pretrained(setup[0]), LoraSection(rank=4), facts)
    peft.merge_adapter()
    with pytest.raises(ArgumentError, match=r"merged into its weights"):
        online_base(peft, facts, model_id=str(setup[0]), dtype=None, outputs=False)
    with pytest.raises(ArgumentError, match=r"anchor.base_dtype: one of"):
        online_base(model, facts, model_id=str(setup[0]), dtype="float8", outputs=False)


def test_output_kd_is_the_hand_kl_of_the_next_token_distributions(setup, tmp_path):
    from rpb.train.run import training_arguments
    from rpb.train.trainer import AnchorTrainer

    cfg = config(setup, tmp_path / "okd", "output-kd", "anchor.lambda=0.7")
    prepared = prepare_run(cfg, progress=False)
    model = prepared.model.train()
    with torch.no_grad():  # a known drift from the base
        gen = torch.Generator().manual_seed(0)
        for n, p in model.named_parameters():
            if "self_attn" in n:
                p.add_(torch.randn(p.shape, generator=gen) * 0.05)
    trainer = AnchorTrainer(model=model, args=training_arguments(cfg, False), train_dataset=prepared.dataset,
                            data_collator=prepared.collator, anchor=prepared.handle)  # fmt: skip
    batch = prepared.collator([prepared.dataset[i] for i in range(4)])
    sample_BT, span_BT = batch.pop("rpb_sample_index"), batch.pop("rpb_span")
    trainer._sample_BT = sample_BT
    with prepared.handle.step(sample_BT, span_BT, batch.get("attention_mask")):
        with_term = trainer.compute_loss(model, dict(batch))
    base = AutoModelForCausalLM.from_pretrained(setup[0]).eval()
    with torch.no_grad():
        plain = model(**batch).loss
        keys = {k: batch[k] for k in ("input_ids", "position_ids", "attention_mask") if k in batch}
        q = torch.log_softmax(base(**keys).logits.double(), -1)
        p = torch.log_softmax(model(**keys).logits.double(), -1)
    labels = batch["labels"]
    rows, cols = torch.nonzero(labels[:, 1:] != -100, as_tuple=True)  # position t predicts token t + 1
    kl = (q[rows, cols].exp() * (q[rows, cols] - p[rows, cols])).sum(-1).mean()
    assert float(kl) > 1e-4
    assert float(with_term.detach() - plain) == pytest.approx(0.7 * float(kl), rel=1e-4)
    prepared.handle.remove()


def test_after_each_base_forward_the_adapters_are_on_and_the_model_computes_the_merged_one(setup):
    """The base forward disables the adapters; the next forward is the trained model's again: the PEFT model's
    logits equal those of a merged copy (adapters given a value: B is 0 at init)."""
    import copy

    from rpb.adapters import get_adapter
    from rpb.teacher import online_base
    from rpb.train.lora import LoraSection, apply_lora

    model = AutoModelForCausalLM.from_pretrained(setup[0])
    facts = get_adapter(model.config.model_type)
    peft = apply_lora(model, LoraSection(rank=4, alpha=8), facts)
    with torch.no_grad():
        for name, p in peft.named_parameters():
            if "lora_B" in name:
                p.normal_(std=0.2, generator=torch.Generator().manual_seed(1))
    merged = copy.deepcopy(peft).merge_and_unload().eval()
    base = AutoModelForCausalLM.from_pretrained(setup[0]).eval()
    teacher = online_base(peft, facts, model_id=str(setup[0]), dtype=None, outputs=True)
    ids = torch.randint(5, 60, (2, 7), generator=torch.Generator().manual_seed(3))
    peft.train()
    for _ in range(3):
        got = teacher.step({"input_ids": ids})
        with torch.no_grad():
            torch.testing.assert_close(got.output_BTV, base(input_ids=ids).logits.float(), rtol=1e-5, atol=1e-5)
            now = peft(input_ids=ids).logits
        torch.testing.assert_close(now, merged(input_ids=ids).logits, rtol=1e-4, atol=1e-4)
        assert not torch.allclose(now, got.output_BTV, atol=1e-3)  # the adapters do change the output
        assert all(m.training for m in peft.modules())  # train mode restored, module by module


def test_a_model_wrapped_with_adapters_after_the_base_was_taken_drops_its_frozen_copy(setup):
    """axolotl and TRL's peft_config wrap the model after the anchor is attached: the reinstalled anchor's base is
    the wrapped model with its adapters disabled, no second copy."""
    from rpb.adapters import get_adapter
    from rpb.anchors import AnchorConfig, install_anchor
    from rpb.teacher import online_base
    from rpb.train.lora import LoraSection, apply_lora

    model = AutoModelForCausalLM.from_pretrained(setup[0])
    facts = get_adapter(model.config.model_type)
    handle = install_anchor(model, AnchorConfig(method="routing-kd", lambda_=1.0))
    handle.teacher = online_base(model, facts, model_id=str(setup[0]), dtype=None, outputs=False)
    assert handle.teacher.mode == "frozen-copy"
    peft = apply_lora(model, LoraSection(rank=4), facts)
    moved = handle.reinstall(peft)
    assert moved.teacher.mode == "adapters-off" and moved.teacher.module is peft and moved.teacher.copy_bytes == 0
    moved.remove()


def test_the_base_runs_without_dropout_so_with_dropout_the_term_at_the_base_is_noise(setup, save_tiny, tmp_path):
    """The base forward is the teacher, in eval mode: q carries no dropout noise, p does (the training forward). With
    dropout 0 the term at step 1 (the model is the base) is 0 (the test above); with attention dropout it is not,
    and docs/methods.md says so. Two base forwards of one batch, the model training, give the same q."""
    model_dir = save_tiny("moonlight", attention_dropout=0.5)
    dropout_setup = (model_dir, *setup[1:])
    out = run_training(config(dropout_setup, tmp_path / "run", "routing-kd", steps=1), progress=False)
    (term,) = [r["anchor_loss"] for r in log_of(out) if "anchor_loss" in r]
    assert term > 1e-4  # p under dropout against q without: dropout's noise in the routing
    run = prepare_run(config(dropout_setup, tmp_path / "again", "routing-kd", steps=1), progress=False)
    batch = run.collator([run.dataset[i] for i in range(4)])
    inputs = {k: batch[k] for k in ("input_ids", "attention_mask")}
    run.model.train()
    first, second = (run.handle.teacher.step(inputs).logits_LTE for _ in range(2))
    assert all(torch.equal(a, b) for a, b in zip(first, second, strict=True))  # no dropout in the base's forward
    text = " ".join((ROOT / "docs" / "methods.md").read_text().split())
    assert "The base's forward runs without dropout" in text
