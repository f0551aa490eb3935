"""``rpb train``'s wiring between its parts, by value against hand computations. Each check has a
companion beside it that patches a realistic bug in and shows the check then fails (docs/testing.md).

- a loss anchor's term reaches the router's gradient as its hand formula says (not dropped, not
  detached), and a large coefficient moves the term's own target against ``sft``;
- gradient accumulation: two micro-batches of 2 rows give the gradient of one batch of 4;
- packing gives the unpacked gradient;
- a checkpoint whose config turns the native load-balancing loss on trains as one without it (and
  ``rpb audit`` says so, and catches the same mutant);
- evaluation through the Trainer never sees the anchor.

Every row of the data has the same length (a character tokenizer, two-digit sums), so micro-batches
and packed rows hold equal numbers of tokens and every per-micro-batch mean is the whole batch's.
The routers are moved off the base after the anchor has copied it: at the base itself the distance
terms and their gradients are 0, which would hide a dropped term.
"""

from __future__ import annotations

import contextlib
import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file
from transformers import AutoModelForCausalLM, Trainer, TrainingArguments

import rpb.train.run
from rpb.anchors import AnchorHandle
from rpb.collect import collect
from rpb.data import AnchorCollator
from rpb.testing.data import write_jsonl
from rpb.train.audit import run_audit
from rpb.train.config import load_config
from rpb.train.run import prepare_run, run_training
from rpb.train.trainer import AnchorTrainer, AnchorTrainerMixin
from tests.conftest import coefficient_overrides, qa
from tests.hand_losses import TERMS, Recorded, RouterRecorder, check_term_in_gradient, move_routers

pytestmark = pytest.mark.usefixtures("one_thread")

ARCH, TOP_K = "qwen3_moe", 2  # softmax routers on layers 1 and 2 (two MoE layers)
LOSSES = ("lbl", "router-l2", "kl-to-base", "logit-l2")
COEF = 2.0  # lambda and lbl_coef: large, so the term's gradient is of the LM loss's size
LR = 1e-3  # Adam moves every weight about LR a step: larger steps overshoot on a model this small


@pytest.fixture(scope="module")
def setup(tmp_path_factory, save_tiny):
    tmp = tmp_path_factory.mktemp("wiring")
    pairs = zip(range(10, 26), range(33, 49), strict=True)
    rows = [qa(f"What is {a} + {b}?", f"{a} + {b} = {a + b}.") for a, b in pairs]
    data = write_jsonl(rows, tmp / "train.jsonl")
    model = save_tiny(ARCH)
    prior = tmp / "prior.safetensors"
    collect(str(model), data, prior, top_k=TOP_K, max_seq_len=192, progress=False)
    base = load_file(model / "model.safetensors")
    base_routers = [base[k].double() for k in sorted(k for k in base if k.endswith("mlp.gate.weight"))]
    return model, data, prior, base_routers


def train(setup, out, method, *extra, steps=1, every_parameter=False) -> Recorded:
    """``rpb train`` for ``steps`` steps with the routers moved off the base, recording what they saw."""
    model, data, prior, _ = setup
    seen = Recorded()

    def recording(cfg, progress=True):
        run = prepare_run(cfg, progress)
        move_routers(run.model)
        run.collator = seen.watch(run.model, run.collator, every_parameter)
        return run

    args = [f"model={model}", f"data_jsonl={data}", f"prior={prior}", f"output_dir={out}", f"anchor.method={method}",
            *coefficient_overrides(method, COEF, COEF), f"train.max_steps={steps}", "train.batch_size=4",
            f"train.lr={LR}", "train.log_every=1", "train.calibrate_rows=0", "train.deterministic=true",
            *extra]  # fmt: skip
    with pytest.MonkeyPatch.context() as m:
        m.setattr(rpb.train.run, "prepare_run", recording)
        seen.out = run_training(load_config(None, args), progress=False)
    seen.rec.remove()
    return seen


# ---- a loss anchor's term in the router's gradient, and what a large coefficient does -------------------


@pytest.fixture(scope="module")
def loss_runs(setup, tmp_path_factory):
    tmp = tmp_path_factory.mktemp("losses")
    return {method: train(setup, tmp / method, method, steps=3) for method in ("sft", *LOSSES)}


def target(method: str, out: Path, batch: dict, base_routers) -> float:
    """The term's own target on the trained weights, mean over MoE layers, computed by hand: the distance to
    the base weights (router-l2), or on the trained model's own router inputs for ``batch``."""
    model = AutoModelForCausalLM.from_pretrained(out)
    rec = RouterRecorder(model)
    model.train()  # the recorder keeps training-mode forwards (with gradients); no dropout in this model
    model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"])
    valid_T = batch["attention_mask"].reshape(-1).bool()
    values = [
        TERMS[method](rec.inputs[pos][0].double(), r.weight.detach().double(), base_routers[pos], valid_T, TOP_K)
        for pos, r in enumerate(rec.routers)
    ]
    return float(torch.stack(values).mean())


def check_target_moves(method: str, run: Recorded, sft: Recorded, base_routers) -> None:
    batch = run.batches[0]
    anchored, plain = target(method, run.out, batch, base_routers), target(method, sft.out, batch, base_routers)
    # measured: lbl 0.57, router-l2 0.975 (Adam's steps are LR whatever the pull), kl-to-base 0.04, logit-l2 0.32
    assert anchored < 0.99 * plain, f"{method}: target {anchored:.5g} against sft's {plain:.5g}"


@pytest.mark.parametrize("method", LOSSES)
def test_the_term_reaches_the_router_gradient_as_its_formula_says(method, loss_runs, setup):
    check_term_in_gradient(method, loss_runs[method], loss_runs["sft"], setup[3], COEF, TOP_K)


@pytest.mark.parametrize("method", LOSSES)
def test_a_large_coefficient_moves_the_terms_own_target(method, loss_runs, setup):
    check_target_moves(method, loss_runs[method], loss_runs["sft"], setup[3])


def test_mutant_anchor_term_detached_is_caught(loss_runs, setup, tmp_path, monkeypatch):
    """The term added to the loss but cut from the graph (or dropped): weights move exactly as sft's."""
    loss = AnchorHandle.loss
    monkeypatch.setattr(AnchorHandle, "loss", lambda self: loss(self).detach())
    run = train(setup, tmp_path, "kl-to-base", steps=3)
    with pytest.raises(AssertionError, match="kl-to-base router 1"):
        check_term_in_gradient("kl-to-base", run, loss_runs["sft"], setup[3], COEF, TOP_K)
    with pytest.raises(AssertionError, match="kl-to-base: target"):
        check_target_moves("kl-to-base", run, loss_runs["sft"], setup[3])


# ---- gradient accumulation, packing: the same gradient as one plain batch ---------------------------------


def check_same_step(a: Recorded, b: Recorded) -> None:
    """One optimizer step: every parameter's accumulated gradient within 1e-5 (relative to its largest
    entry), and the weights after the step within 1e-5."""
    assert a.rec.last_grads.keys() == b.rec.last_grads.keys() and a.rec.last_grads
    for name, grad in a.rec.last_grads.items():
        other = b.rec.last_grads[name]
        assert (grad - other).abs().max() <= 1e-5 * grad.abs().max().clamp_min(1e-12), name
    wa, wb = load_file(a.out / "model.safetensors"), load_file(b.out / "model.safetensors")
    assert max(float((wa[k] - wb[k]).abs().max()) for k in wa) <= 1e-5


@pytest.fixture(scope="module")
def accumulated(setup, tmp_path_factory):
    tmp = tmp_path_factory.mktemp("accumulation")
    runs = {}
    for method in ("sft", "kl-to-base"):
        for ga in (1, 2):
            args = (f"train.grad_accum={ga}", f"train.batch_size={4 // ga}")
            runs[method, ga] = train(setup, tmp / f"{method}-{ga}", method, *args, every_parameter=True)
    return runs


@pytest.mark.parametrize("method", ["sft", "kl-to-base"])
def test_two_accumulated_micro_batches_are_one_batch(method, accumulated):
    one, two = accumulated[method, 1], accumulated[method, 2]
    # the same 4 rows (the data loader collates a batch ahead: later batches never trained)
    assert torch.equal(torch.cat([b["input_ids"] for b in two.batches[:2]]), one.batches[0]["input_ids"])
    check_same_step(one, two)


def test_mutant_anchor_term_not_divided_by_accumulation_is_caught(accumulated, setup, tmp_path, monkeypatch):
    """The per-micro-batch term added whole at every micro-batch: the anchor counts twice under grad_accum 2."""
    monkeypatch.setattr(AnchorTrainerMixin, "_anchor_divisor", lambda self, n: 1)
    two = train(setup, tmp_path, "kl-to-base", "train.grad_accum=2", "train.batch_size=2", every_parameter=True)
    with pytest.raises(AssertionError, match=r"mlp\.gate\.weight"):
        check_same_step(accumulated["kl-to-base", 1], two)


@pytest.fixture(scope="module")
def packing(setup, tmp_path_factory):
    tmp = tmp_path_factory.mktemp("packing")
    return [train(setup, tmp / str(p), "rpb", f"data.packing={str(p).lower()}", every_parameter=True)
            for p in (False, True)]  # fmt: skip


def test_packing_gives_the_unpacked_step(packing):
    plain, packed = packing
    assert packed.batches[0]["input_ids"].shape[0] < plain.batches[0]["input_ids"].shape[0]  # rows were packed
    check_same_step(plain, packed)


def test_mutant_packed_examples_attending_to_each_other_is_caught(packing, setup, tmp_path, monkeypatch):
    """Packed rows that carry an attention mask (of ones): transformers then lets every token attend to the
    whole row, across examples (rpb train shipped this way until the check above found it)."""
    collate = AnchorCollator.__call__

    def with_mask(self, features):
        batch = collate(self, features)
        batch.setdefault("attention_mask", (batch["rpb_sample_index"] >= 0).long())
        return batch

    monkeypatch.setattr(AnchorCollator, "__call__", with_mask)
    packed = train(setup, tmp_path, "rpb", "data.packing=true", every_parameter=True)
    with pytest.raises(AssertionError, match="weight"):
        check_same_step(packing[0], packed)


# ---- a checkpoint with the native load-balancing loss switched on ------------------------------------------


def check_no_native_aux_loss(plain: Recorded, aux: Recorded) -> None:
    logged = [[r["loss"] for r in map(json.loads, (run.out / "log.jsonl").read_text().splitlines()) if "loss" in r]
              for run in (plain, aux)]  # fmt: skip
    assert len(logged[0]) == 1 and logged[0] == logged[1], f"logged loss {logged[1]} against {logged[0]} without it"
    check_same_step(plain, aux)


@pytest.fixture(scope="module")
def native_aux(setup, save_tiny, tmp_path_factory):
    """The same weights saved with ``output_router_logits: true`` and a large ``router_aux_loss_coef``."""
    model = save_tiny(ARCH, output_router_logits=True, router_aux_loss_coef=0.5)
    assert json.loads((model / "config.json").read_text())["output_router_logits"] is True
    return (model, *setup[1:])


@pytest.fixture(scope="module")
def aux_runs(setup, native_aux, tmp_path_factory):
    tmp = tmp_path_factory.mktemp("aux")
    return [train(s, tmp / name, "sft", every_parameter=True) for name, s in (("plain", setup), ("aux", native_aux))]


def audit_sft(setup, tmp_path) -> list[str]:
    """``rpb audit``'s contradictions for ``sft`` on ``setup``: the same check, run as a user would."""
    model, data, prior, _ = setup
    return run_audit(None, [f"model={model}", f"data_jsonl={data}", f"prior={prior}", f"output_dir={tmp_path}",
                            "anchor.method=sft", "train.batch_size=4"]).contradictions  # fmt: skip


def test_a_checkpoint_with_the_native_aux_loss_on_trains_without_it(aux_runs, native_aux, tmp_path):
    check_no_native_aux_loss(*aux_runs)
    assert audit_sft(native_aux, tmp_path) == []


def test_mutant_native_aux_loss_left_on_is_caught(aux_runs, native_aux, tmp_path, monkeypatch):
    """install_anchor forgets to turn ``output_router_logits`` off: the model adds its own loss."""
    install = rpb.train.run.install_anchor

    def leave_it_on(model, *args, **kwargs):
        handle = install(model, *args, **kwargs)
        model.config.output_router_logits = handle.native_output_router_logits
        return handle

    monkeypatch.setattr(rpb.train.run, "install_anchor", leave_it_on)
    aux = train(native_aux, tmp_path, "sft", every_parameter=True)
    with pytest.raises(AssertionError, match="logged loss"):
        check_no_native_aux_loss(aux_runs[0], aux)
    (found,) = audit_sft(native_aux, tmp_path / "audit")
    assert found.startswith("no native load-balancing loss asked, but the model's own is in the loss")


# ---- evaluation through the Trainer -------------------------------------------------------------------------


def evaluate_anchored(setup, tmp_path, method: str, **anchor) -> float:
    """The Trainer's eval_loss on the training rows with ``method`` installed (``beta`` far from 0)."""
    model, data, prior, _ = setup
    cfg = load_config(None, [f"model={model}", f"data_jsonl={data}", f"prior={prior}", f"output_dir={tmp_path}",
                             f"anchor.method={method}", "anchor.beta=8", *coefficient_overrides(method, COEF, COEF),
                             "train.calibrate_rows=0", "train.batch_size=4"])  # fmt: skip
    run = prepare_run(cfg, progress=False)
    move_routers(run.model)  # the loss anchors' terms are not 0
    args = rpb.train.run.training_arguments(cfg, progress=False)
    trainer = AnchorTrainer(model=run.model, args=args, eval_dataset=run.dataset, data_collator=run.collator,
                            anchor=run.handle)  # fmt: skip
    try:
        return trainer.evaluate()["eval_loss"]
    finally:
        run.handle.remove()


def evaluate_plain(setup, tmp_path) -> float:
    """transformers' own Trainer on the same rows and weights, no rpb installed (its keys dropped)."""
    cfg = load_config(None, [f"model={setup[0]}", f"data_jsonl={setup[1]}", f"output_dir={tmp_path}",
                             "anchor.method=sft", "train.max_seq_len=192", "train.batch_size=4"])  # fmt: skip
    run = prepare_run(cfg, progress=False)
    run.handle.remove()
    move_routers(run.model)
    collate = run.collator

    def plain(features):
        return {k: v for k, v in collate(features).items() if not k.startswith("rpb_")}

    args = TrainingArguments(output_dir=str(tmp_path), per_device_eval_batch_size=4, use_cpu=True, report_to=[],
                             remove_unused_columns=False, disable_tqdm=True)  # fmt: skip
    return Trainer(model=run.model, args=args, eval_dataset=run.dataset, data_collator=plain).evaluate()["eval_loss"]


def check_eval_untouched(setup, tmp_path) -> None:
    reference = evaluate_plain(setup, tmp_path / "plain")
    for method in ("rpb", "kl-to-base"):
        got = evaluate_anchored(setup, tmp_path / method, method)
        assert got == pytest.approx(reference, abs=1e-6), f"{method}: eval_loss {got} against {reference}"


def test_evaluation_never_sees_the_anchor(setup, tmp_path):
    check_eval_untouched(setup, tmp_path)


def test_mutant_bias_applied_in_evaluation_is_caught(setup, tmp_path, monkeypatch):
    """An evaluation step that runs with the anchor applied, as training does."""
    predict = AnchorTrainerMixin.prediction_step

    def biased(self, model, inputs, *args, **kwargs):
        ctx = self.anchor.step(inputs["rpb_sample_index"], inputs["rpb_span"], inputs.get("attention_mask"))
        with self.anchor.applied_in_eval(), ctx if self.anchor.prior is not None else contextlib.nullcontext():
            return predict(self, model, inputs, *args, **kwargs)

    monkeypatch.setattr(AnchorTrainerMixin, "prediction_step", biased)
    with pytest.raises(AssertionError, match="rpb: eval_loss"):
        check_eval_untouched(setup, tmp_path)
