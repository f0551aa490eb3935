"""``rpb.integrations.trl`` on tiny DeepSeek-V3 (Moonlight) and Qwen3-MoE models, against TRL itself.

The references are independent of rpb's routing code: plain ``trl.SFTTrainer`` on the same
pre-tokenized ``input_ids`` / ``labels``, and each architecture's expert selection written out
below (the transformers source: Qwen3-MoE softmax then top-k; DeepSeek-V3 sigmoid plus the
expert-correction bias, then top-k; the tiny Moonlight has one expert group) on the logits the
router itself returned, with the eq. 3 bias computed by hand from the prior's rows.
"""

from __future__ import annotations

import importlib.util
from pathlib import Path

import datasets
import pytest
import torch
import trl
from safetensors.torch import load_file
from transformers import AutoModelForCausalLM

from rpb.anchors import METHODS, AnchorConfig, AnchorHandle
from rpb.collect import collect
from rpb.data import ExampleDataset
from rpb.errors import ConfigError
from rpb.integrations.trl import SFTConfig, SFTTrainer, prepare
from rpb.models import load_tokenizer
from rpb.prior.artifact import load_artifact
from rpb.testing.data import conversations, write_jsonl
from rpb.testing.models import ARCHITECTURES
from rpb.train.trainer import AnchorTrainerMixin
from tests.hand_losses import Recorded, check_term_in_gradient, move_routers
from tests.hand_routing import hand_select, token_bias

ARCHS = ("moonlight", "qwen3_moe")
STEPS = 2
ROOT = Path(__file__).resolve().parents[3]

pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture(scope="module")
def setup(tmp_path_factory, save_tiny):
    tmp = tmp_path_factory.mktemp("trl")
    data = write_jsonl(conversations(12, seed=3), tmp / "train.jsonl")
    out = {}
    for arch in ARCHS:
        model = save_tiny(arch)
        prior = tmp / f"{arch}.safetensors"
        top_k = ARCHITECTURES[arch][1]["num_experts_per_tok"]
        collect(str(model), data, prior, top_k=top_k, max_seq_len=192, progress=False)
        out[arch] = (model, data, prior)
    return out


def config(tmp_path, **overrides) -> dict:
    base = dict(output_dir=str(tmp_path), max_steps=STEPS, per_device_train_batch_size=4, learning_rate=1e-3,
                logging_steps=1, save_strategy="no", report_to=[], bf16=False, gradient_checkpointing=False,
                use_cpu=True, seed=7, dataloader_num_workers=0, disable_tqdm=True)  # fmt: skip
    return {**base, **overrides}


def anchored(setup, arch, tmp_path, method="rpb", beta=1.0, args=None, **kwargs):
    model_dir, data, prior = setup[arch]
    model = AutoModelForCausalLM.from_pretrained(model_dir)
    tok = load_tokenizer(str(model_dir))
    anchor = AnchorConfig.for_method(method, beta=beta, lambda_=0.1, lbl_coef=0.01)
    handle, rows = prepare(model, tok, str(data), anchor, str(prior))
    trainer = SFTTrainer(model, args or SFTConfig(**config(tmp_path)), rows, anchor=handle, processing_class=tok,
                         **kwargs)  # fmt: skip
    return trainer, handle, rows


def train_recording(trainer) -> list[float]:
    """Train; the loss of every step, exactly as the Trainer returned it."""
    losses: list[float] = []
    step = trainer.training_step

    def recorded(*args, **kwargs):
        loss = step(*args, **kwargs)
        losses.append(float(loss))
        return loss

    trainer.training_step = recorded
    trainer.train()
    return losses


def weights(model) -> dict[str, torch.Tensor]:
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


def routers(model) -> list[torch.nn.Module]:
    return [m for name, m in model.named_modules() if name.endswith("mlp.gate")]


def record_routing(trainer):
    """Every training forward: its batch's keys and, per router, (logits, chosen sets) after the anchor's
    hook. Batches are paired with forwards in order (the data loader collates one batch ahead)."""
    batches: list[dict] = []
    forwards: list[list] = []
    collate = trainer.data_collator
    n = len(routers(trainer.model))

    def keep_batch(features):
        batch = collate(features)
        batches.append({"sample": batch["rpb_sample_index"].clone(), "span": batch["rpb_span"].clone()})
        return batch

    trainer.data_collator = keep_batch

    def hook(module, args, out):
        if module.training:
            if not forwards or len(forwards[-1]) == n:
                forwards.append([])
            forwards[-1].append((out[0].detach().clone(), [frozenset(r) for r in out[2].tolist()]))

    hooks = [r.register_forward_hook(hook) for r in routers(trainer.model)]

    def seen() -> list[dict]:
        return [{**b, "routers": f} for b, f in zip(batches, forwards, strict=False)]

    return seen, hooks


def token_keys(batch: dict) -> list[tuple[int, int]]:
    keys = zip(batch["sample"].reshape(-1).tolist(), batch["span"].reshape(-1).tolist(), strict=True)
    return [k for k in keys if k[0] >= 0]


def check_against_hand(arch, trainer, seen, prior_path, beta):
    pi = load_artifact(prior_path).prior_qa
    k = ARCHITECTURES[arch][1]["num_experts_per_tok"]
    moe = routers(trainer.model)
    for batch in seen:
        sample_T, span_T = batch["sample"].reshape(-1), batch["span"].reshape(-1)
        assert len(batch["routers"]) == len(moe) and ((sample_T >= 0) & (span_T >= 0)).any()
        for layer, (z_TE, chosen) in enumerate(batch["routers"]):
            expert_bias = getattr(moe[layer], "e_score_correction_bias", None)
            bias_TE = token_bias(pi, layer, sample_T, span_T, beta)
            assert chosen == hand_select(z_TE, bias_TE, k, expert_bias), f"{arch} layer {layer}"


def plain_trl(model_dir, rows, out, evaluate: bool = False) -> trl.SFTTrainer:
    """TRL's own SFTTrainer, nothing of rpb, on the same pre-tokenized input_ids / labels (as eval_dataset too)."""
    examples = ExampleDataset(rows.examples, "answer")
    pretokenized = datasets.Dataset.from_dict({
        "input_ids": [e["input_ids"] for e in examples], "labels": [e["labels"] for e in examples],
    })  # fmt: skip
    args = trl.SFTConfig(**config(out), router_aux_loss_coef=0.0, dataset_kwargs={"skip_prepare_dataset": True})
    return trl.SFTTrainer(AutoModelForCausalLM.from_pretrained(model_dir), args, train_dataset=pretokenized,
                          eval_dataset=pretokenized if evaluate else None,
                          processing_class=load_tokenizer(str(model_dir)))  # fmt: skip


# ---- beta 0 is TRL's own SFTTrainer, bit for bit ---------------------------------------------
@pytest.mark.parametrize("arch", ARCHS)
def test_beta_zero_is_plain_sft_trainer_bit_for_bit(setup, arch, tmp_path):
    trainer, handle, rows = anchored(setup, arch, tmp_path / "rpb", beta=0.0)
    mine = train_recording(trainer)
    handle.remove()

    plain = plain_trl(setup[arch][0], rows, tmp_path / "plain")
    theirs = train_recording(plain)

    assert len(mine) == STEPS and mine == theirs
    a, b = weights(trainer.model), weights(plain.model)
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


# ---- beta 1: another run, and every step's selection is the hand-written one ------------------
@pytest.mark.parametrize("arch", ARCHS)
def test_beta_one_selects_what_the_hand_selection_selects(setup, arch, tmp_path):
    zero, h0, _ = anchored(setup, arch, tmp_path / "b0", beta=0.0)
    train_recording(zero)
    h0.remove()
    one, h1, _ = anchored(setup, arch, tmp_path / "b1", beta=1.0)
    seen, hooks = record_routing(one)
    train_recording(one)
    seen = seen()
    for h in hooks:
        h.remove()
    h1.remove()
    assert len(seen) == STEPS
    check_against_hand(arch, one, seen, setup[arch][2], beta=1.0)
    a, b = weights(zero.model), weights(one.model)
    assert any(not torch.equal(a[k], b[k]) for k in a), "beta 1 trained exactly like beta 0"


# ---- no hidden auxiliary loss -----------------------------------------------------------------
@pytest.mark.parametrize("arch", ARCHS)
def test_no_native_aux_loss_under_any_method(setup, arch, tmp_path):
    """With the model config asking for a (large) native load-balancing loss, every method's loss is
    the loss of the same run with TRL's coefficient 0.0 on a config that asks for none."""
    for method in METHODS:
        with_aux = anchored_with_config(setup, arch, tmp_path / method / "aux", method, aux=True)
        without = anchored_with_config(setup, arch, tmp_path / method / "none", method, aux=False)
        assert with_aux == without, method


def anchored_with_config(setup, arch, tmp_path, method, aux: bool) -> list[float]:
    model_dir, data, prior = setup[arch]
    model = AutoModelForCausalLM.from_pretrained(model_dir)
    if aux:  # a config that asks for a large native load-balancing loss (DeepSeek-V3's declares none: given one)
        model.config.output_router_logits, model.config.router_aux_loss_coef = True, 0.5
    tok = load_tokenizer(str(model_dir))
    handle, rows = prepare(
        model, tok, str(data), AnchorConfig.for_method(method, lambda_=0.1, lbl_coef=0.01), str(prior)
    )
    # aux: the integration's default; otherwise TRL's own switch, set explicitly
    args = SFTConfig(**config(tmp_path, max_steps=1)) if aux else SFTConfig(**config(tmp_path, max_steps=1),
                                                                             router_aux_loss_coef=0.0)  # fmt: skip
    trainer = SFTTrainer(model, args, rows, anchor=handle, processing_class=tok)
    assert model.config.output_router_logits is False and trainer.aux_loss_enabled is False
    losses = train_recording(trainer)
    handle.remove()
    return losses


def test_the_trap_is_real_plain_trl_adds_the_configs_aux_loss(setup, tmp_path):
    """The failure the integration prevents: TRL left to itself picks up the config's coefficient."""
    model_dir = setup["qwen3_moe"][0]
    model = AutoModelForCausalLM.from_pretrained(model_dir, output_router_logits=False, router_aux_loss_coef=0.5)
    pretokenized = datasets.Dataset.from_dict({"input_ids": [[5, 6, 7, 8]], "labels": [[5, 6, 7, 8]]})
    args = trl.SFTConfig(**config(tmp_path), dataset_kwargs={"skip_prepare_dataset": True})
    plain = trl.SFTTrainer(model, args, train_dataset=pretokenized, processing_class=load_tokenizer(str(model_dir)))
    assert plain.aux_loss_enabled and model.config.output_router_logits is True


def test_a_nonzero_coefficient_is_refused_with_its_message(setup, tmp_path):
    with pytest.raises(ConfigError, match=r"router_aux_loss_coef=0\.001.*anchor\.method=lbl"):
        anchored(setup, "qwen3_moe", tmp_path, args=SFTConfig(**config(tmp_path), router_aux_loss_coef=0.001))
    with pytest.raises(ConfigError, match="router_aux_loss_coef"):  # TRL's own config, left unset, is fine; set is not
        anchored(setup, "qwen3_moe", tmp_path, args=trl.SFTConfig(**config(tmp_path), router_aux_loss_coef=0.01))


def test_trl_config_left_unset_gets_zero_and_says_so_once(setup, tmp_path, caplog, monkeypatch):
    monkeypatch.setattr("rpb.integrations.trl.sft._TOLD", False)
    with caplog.at_level("WARNING", logger="rpb.integrations.trl"):
        trainer, handle, _ = anchored(setup, "qwen3_moe", tmp_path, args=trl.SFTConfig(**config(tmp_path)))
        handle.remove()
        anchored(setup, "qwen3_moe", tmp_path)[1].remove()
    assert trainer.args.router_aux_loss_coef == 0.0 and not trainer.aux_loss_enabled
    notes = [r.getMessage() for r in caplog.records if "router_aux_loss_coef=0.0" in r.getMessage()]
    assert len(notes) == 1 and "(set by rpb: TRL's unset value means the model config's)" in notes[0]


# ---- packing ------------------------------------------------------------------------------------
@pytest.mark.parametrize("arch", ARCHS)
def test_packing_keeps_every_tokens_bias_and_equals_unpacked(setup, arch, tmp_path):
    flat, hf, _ = anchored(setup, arch, tmp_path / "flat")
    flat_seen, hooks = record_routing(flat)
    flat_losses = train_recording(flat)
    flat_seen = flat_seen()
    [h.remove() for h in hooks]
    hf.remove()
    packed, hp, _ = anchored(setup, arch, tmp_path / "packed", args=SFTConfig(**config(tmp_path), packing=True))
    seen, hooks = record_routing(packed)
    losses = train_recording(packed)
    seen = seen()
    [h.remove() for h in hooks]
    hp.remove()

    for a, b in zip(flat_seen, seen, strict=True):
        assert b["sample"].shape[0] == 1 and a["sample"].shape[0] == 4  # one row, no padding
        assert token_keys(a) == token_keys(b)
    check_against_hand(arch, packed, seen, setup[arch][2], beta=1.0)
    # attention stays inside each example: the same loss up to summation order
    assert losses == pytest.approx(flat_losses, rel=1e-5)


# ---- checkpointing ------------------------------------------------------------------------------
def test_reentrant_checkpointing_with_a_loss_anchor_is_refused_at_construction(setup, tmp_path):
    reentrant = dict(gradient_checkpointing=True, gradient_checkpointing_kwargs={"use_reentrant": True})
    with pytest.raises(ConfigError, match=r"use_reentrant=True.*kl-to-base"):
        anchored(setup, "qwen3_moe", tmp_path, method="kl-to-base", args=SFTConfig(**config(tmp_path, **reentrant)))
    # the bias alone only chooses experts: recomputation under the same context chooses the same ones
    _, handle, _ = anchored(setup, "qwen3_moe", tmp_path, args=SFTConfig(**config(tmp_path, **reentrant)))
    handle.remove()


def test_other_collators_are_refused(setup, tmp_path):
    with pytest.raises(ConfigError, match="AnchorCollator"):
        anchored(setup, "qwen3_moe", tmp_path, data_collator=lambda features: features)


# ---- the checkpoint -----------------------------------------------------------------------------
def test_the_saved_checkpoint_is_plain_transformers(setup, tmp_path):
    trainer, handle, _ = anchored(setup, "qwen3_moe", tmp_path)
    trainer.train()
    trainer.save_model(str(tmp_path / "out"))
    handle.remove()
    # transformers' own loader, nothing of rpb's: the trained weights come back, under their own names
    reloaded = AutoModelForCausalLM.from_pretrained(tmp_path / "out")
    trained, back = weights(trainer.model), weights(reloaded)
    assert back.keys() == trained.keys() and all(torch.equal(back[k], trained[k]) for k in back)
    assert not any("rpb" in k for k in load_file(tmp_path / "out" / "model.safetensors"))
    base = AutoModelForCausalLM.from_pretrained(setup["qwen3_moe"][0])
    # the config's own aux-loss settings, not the values the run trained under
    assert reloaded.config.router_aux_loss_coef == base.config.router_aux_loss_coef
    assert reloaded.config.output_router_logits == base.config.output_router_logits


def test_the_shipped_trl_example_trains_and_saves(setup, tmp_path):
    spec = importlib.util.spec_from_file_location("trl_example", ROOT / "examples" / "trl" / "sft.py")
    example = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(example)
    model_dir, data, prior = setup["moonlight"]
    out = tmp_path / "run"
    assert example.main([
        "--model", str(model_dir), "--data-jsonl", str(data), "--prior", str(prior), "--output-dir", str(out),
        "--max-steps", "2", "--per-device-batch-size", "2", "--grad-accum", "1", "--dtype", "float32",
    ]) == 0  # fmt: skip
    trained = AutoModelForCausalLM.from_pretrained(out)
    base = AutoModelForCausalLM.from_pretrained(model_dir)
    a, b = weights(trained), weights(base)
    assert any(not torch.equal(a[k], b[k]) for k in a)


def test_peft_config_through_trl_moves_the_anchor_onto_the_router_that_runs(setup, tmp_path):
    """TRL wraps the model itself; with the router under modules_to_save its copy runs, so the anchor
    must follow: the copy trains, the original never runs, every step's selection is the hand one."""
    from peft import LoraConfig

    model_dir, data, prior = setup["qwen3_moe"]
    model = AutoModelForCausalLM.from_pretrained(model_dir)
    tok = load_tokenizer(str(model_dir))
    handle, rows = prepare(model, tok, str(data), AnchorConfig(method="rpb", beta=1.0), str(prior))
    lora = LoraConfig(r=4, lora_alpha=8, lora_dropout=0.0, target_modules=["q_proj", "v_proj"],
                      modules_to_save=["mlp.gate"])  # fmt: skip
    trainer = SFTTrainer(model, SFTConfig(**config(tmp_path)), rows, anchor=handle, processing_class=tok,
                         peft_config=lora)  # fmt: skip
    assert trainer.anchor is not handle and trainer.anchor.model is trainer.model
    copies = [m.modules_to_save["default"] for n, m in trainer.model.named_modules() if n.endswith("mlp.gate")]
    before = [c.weight.detach().clone() for c in copies]
    seen, hooks = record_routing(trainer)
    train_recording(trainer)
    [h.remove() for h in hooks]
    trainer.anchor.remove()
    check_against_hand("qwen3_moe", trainer, seen(), prior, beta=1.0)
    assert all(not torch.equal(c.weight, b) for c, b in zip(copies, before, strict=True))


def test_routing_kd_under_trls_peft_config_takes_the_model_with_its_adapters_off_as_the_base(setup, tmp_path):
    """prepare() takes the base as a frozen copy; TRL then wraps the model with LoRA, and the moved anchor's base is
    the wrapped model with its adapters disabled: step 1 trains the base itself (B = 0), so its term is 0."""
    from peft import LoraConfig

    model_dir, data, _ = setup["qwen3_moe"]
    model = AutoModelForCausalLM.from_pretrained(model_dir)
    tok = load_tokenizer(str(model_dir))
    handle, rows = prepare(model, tok, str(data), AnchorConfig(method="routing-kd", lambda_=1.0), max_seq_len=192,
                           model_id=str(model_dir))  # fmt: skip
    lora = LoraConfig(r=4, lora_alpha=8, lora_dropout=0.0, target_modules=["q_proj", "v_proj"])
    trainer = SFTTrainer(model, SFTConfig(**config(tmp_path, max_steps=3, learning_rate=1e-2)), rows, anchor=handle,
                         processing_class=tok, peft_config=lora)  # fmt: skip
    assert trainer.anchor.teacher.mode == "adapters-off" and trainer.anchor.teacher.module is trainer.model
    trainer.train()
    terms = [h["anchor_loss"] for h in trainer.state.log_history if "anchor_loss" in h]
    assert terms[0] == pytest.approx(0.0, abs=1e-6) and terms[-1] > 0
    # the same keys rpb train logs, with no configuration: LoRA froze the routers, so the router-level overlap stays
    # 1 while the routing on the model's own hidden states moves away from the base's (the figure LoRA users need)
    logs = [h for h in trainer.state.log_history if "loss" in h]
    assert len(logs) == 3 and all("anchor/overlap" in h and "anchor/overlap_min" in h for h in logs)
    assert logs[0]["anchor/overlap"] == 1.0 and logs[0]["routing/mean/base_forward_topk_overlap"] == 1.0
    assert logs[-1]["anchor/overlap"] < 1.0 and logs[-1]["routing/mean/base_forward_topk_overlap"] < 1.0
    assert all(h["routing/mean/topk_overlap"] == 1.0 for h in logs)
    trainer.anchor.remove()


# ---- a loss anchor's term in the router gradient, and evaluation, under TRL --------------------
COEF = 2.0


def trl_step(setup, tmp_path, method: str) -> Recorded:
    """One step of ``method`` (coefficient COEF) on qwen3_moe with the routers moved off the base after the
    anchor copied it, recording what the routers saw."""
    model_dir, data, prior = setup["qwen3_moe"]
    model = AutoModelForCausalLM.from_pretrained(model_dir)
    tok = load_tokenizer(str(model_dir))
    handle, rows = prepare(
        model, tok, str(data), AnchorConfig.for_method(method, lambda_=COEF, lbl_coef=COEF), str(prior)
    )
    trainer = SFTTrainer(model, SFTConfig(**config(tmp_path, max_steps=1)), rows, anchor=handle, processing_class=tok)
    move_routers(trainer.model)
    seen = Recorded()
    trainer.data_collator = seen.watch(trainer.model, trainer.data_collator)
    trainer.train()
    seen.rec.remove()
    handle.remove()
    return seen


@pytest.fixture(scope="module")
def trl_sft(setup, tmp_path_factory):
    model_dir = setup["qwen3_moe"][0]
    base = load_file(model_dir / "model.safetensors")
    base_routers = [base[k].double() for k in sorted(k for k in base if k.endswith("mlp.gate.weight"))]
    return trl_step(setup, tmp_path_factory.mktemp("trl-sft"), "sft"), base_routers


@pytest.mark.parametrize("method", ["lbl", "router-l2", "kl-to-base", "logit-l2"])
def test_the_loss_terms_gradient_is_its_formulas(method, setup, trl_sft, tmp_path):
    sft, base_routers = trl_sft
    check_term_in_gradient(method, trl_step(setup, tmp_path, method), sft, base_routers, COEF, 2)


def test_mutant_anchor_term_detached_under_trl_is_caught(setup, trl_sft, tmp_path, monkeypatch):
    loss = AnchorHandle.loss
    monkeypatch.setattr(AnchorHandle, "loss", lambda self: loss(self).detach())
    sft, base_routers = trl_sft
    with pytest.raises(AssertionError, match="kl-to-base router 1"):
        check_term_in_gradient("kl-to-base", trl_step(setup, tmp_path, "kl-to-base"), sft, base_routers, COEF, 2)


def check_trl_eval_untouched(setup, tmp_path) -> None:
    """eval_dataset through rpb's SFTTrainer with rpb (beta 8) installed == plain TRL on the same rows."""
    model_dir, data, prior = setup["qwen3_moe"]
    tok = load_tokenizer(str(model_dir))
    model = AutoModelForCausalLM.from_pretrained(model_dir)
    handle, rows = prepare(model, tok, str(data), AnchorConfig(method="rpb", beta=8.0), str(prior))
    mine = SFTTrainer(model, SFTConfig(**config(tmp_path / "rpb")), rows, anchor=handle, processing_class=tok,
                      eval_dataset=rows).evaluate()["eval_loss"]  # fmt: skip
    handle.remove()
    theirs = plain_trl(model_dir, rows, tmp_path / "plain", evaluate=True).evaluate()["eval_loss"]
    assert mine == pytest.approx(theirs, abs=1e-6), f"eval_loss {mine} against plain TRL's {theirs}"


def test_evaluation_never_sees_the_anchor(setup, tmp_path):
    check_trl_eval_untouched(setup, tmp_path)


def test_mutant_bias_applied_in_trl_evaluation_is_caught(setup, tmp_path, monkeypatch):
    """An evaluation step that runs with the anchor applied, as training does."""
    predict = AnchorTrainerMixin.prediction_step

    def biased(self, model, inputs, *args, **kwargs):
        with self.anchor.applied_in_eval(), self.anchor.step(inputs["rpb_sample_index"], inputs["rpb_span"],
                                                             inputs.get("attention_mask")):  # fmt: skip
            return predict(self, model, inputs, *args, **kwargs)

    monkeypatch.setattr(AnchorTrainerMixin, "prediction_step", biased)
    with pytest.raises(AssertionError, match="eval_loss"):
        check_trl_eval_untouched(setup, tmp_path)


def test_a_coefficient_already_zero_is_said_plainly(setup, tmp_path, caplog, monkeypatch):
    """The note for a config that set 0.0 itself reads ``router_aux_loss_coef=0.0;``, never ``0.0 (0.0)``."""
    monkeypatch.setattr("rpb.integrations.trl.sft._TOLD", False)
    with caplog.at_level("WARNING", logger="rpb.integrations.trl"):
        anchored(setup, "qwen3_moe", tmp_path)[1].remove()  # rpb's SFTConfig: 0.0 already
    notes = [r.getMessage() for r in caplog.records if "router_aux_loss_coef=0.0" in r.getMessage()]
    assert len(notes) == 1 and notes[0].startswith("rpb: router_aux_loss_coef=0.0; no native")
