"""rpb's GRPOTrainer (TRL's, the installed release) on a tiny Qwen3-MoE: every anchor with every replay mode, the
anchors' terms in the router gradient against their formulas (tests/hand_losses.py) over the completion tokens,
TRL's load-balancing coefficient held at 0, routes carried through TRL's buffer and replayed, and the refusals."""

from __future__ import annotations

import datasets
import pytest
import torch

from rpb.adapters import find_moe_layers, get_adapter
from rpb.anchors import AnchorConfig, install_anchor
from rpb.collect import collect
from rpb.errors import ConfigError
from rpb.integrations.trl import GRPOConfig, GRPOTrainer
from rpb.testing.data import conversations, write_jsonl
from rpb.testing.models import ARCHITECTURES, build_tiny_model, randomize_routers
from tests.hand_losses import RouterRecorder, move_routers, term_gradient

pytestmark = pytest.mark.usefixtures("one_thread")

COEF = 2.0
TOP_K = ARCHITECTURES["qwen3_moe"][1]["num_experts_per_tok"]
PROMPTS = ["abc def", "hello wor", "one two three", "xyz", "a b", "qq rr ss"]
ANCHORS = ["sft", "kl-to-base", "router-l2", "logit-l2", "lbl", "router-freeze"]


def reward(completions, **kwargs):
    return [float(c.count("a") + c.count("e")) for c in completions]


def grpo_args(tmp_path, **overrides) -> GRPOConfig:
    base = dict(output_dir=str(tmp_path), max_steps=3, per_device_train_batch_size=4, num_generations=4,
                max_completion_length=6, learning_rate=1e-3, logging_steps=1, save_strategy="no", report_to=[],
                use_cpu=True, seed=7, disable_tqdm=True, beta=0.0, bf16=False)  # fmt: skip
    return GRPOConfig(**{**base, **overrides})


def anchor_config(method: str) -> AnchorConfig:
    return AnchorConfig.for_method(method, lambda_=COEF, lbl_coef=COEF)


def trainer_for(tok, tmp_path, method="sft", seed=0, arch="qwen3_moe", **overrides):
    model = build_tiny_model(arch, len(tok), seed=seed).train()
    anchor = install_anchor(model, anchor_config(method))
    data = datasets.Dataset.from_list([{"prompt": p} for p in PROMPTS])
    trainer = GRPOTrainer(model, reward, grpo_args(tmp_path, **overrides), data, processing_class=tok, anchor=anchor)
    return trainer, anchor


@pytest.mark.parametrize("replay", ["off", "R2", "R3", "PR2"])
@pytest.mark.parametrize("method", ANCHORS)
def test_every_anchor_with_every_replay_mode_trains_three_steps(method, replay, tok, tmp_path):
    trainer, anchor = trainer_for(tok, tmp_path, method, replay=replay, num_iterations=2)
    assert trainer.router_aux_loss_coef == 0.0 and not trainer.aux_loss_enabled
    # TRL's model config still declares its own coefficient: TRL's default would have read it
    assert trainer.model.config.router_aux_loss_coef > 0
    trainer.train()
    logs = [h for h in trainer.state.log_history if "loss" in h]
    assert len(logs) == 3 and all(torch.isfinite(torch.tensor(h["loss"])) for h in logs)
    assert not any("aux_loss" in h for h in logs)  # TRL's own term never ran
    # R3 logs the choices it overrides, every other mode the flip rate (docs/rl.md)
    flips = "routing/rollout_override_rate" if replay == "R3" else "routing/rollout_flip_rate"
    assert any(flips in h for h in logs)
    assert any("routing/stale_mismatch/update_1" in h for h in logs)  # num_iterations=2: a later update
    if anchor.method.loss is not None:  # the anchor's term in GRPO's logs, as in SFT's
        assert all(f"anchor/{method}" in h for h in logs)
    if method == "router-freeze":
        assert all(not m.router.weight.requires_grad for m in trainer.replay.layers)
    anchor.remove()
    trainer.replay.remove()


def test_trl_left_alone_adds_its_load_balancing_loss(tok, tmp_path):
    """The trap the integration removes: TRL's own trainer, its default coefficient, the same model."""
    import trl

    model = build_tiny_model("qwen3_moe", len(tok), seed=0).train()
    data = datasets.Dataset.from_list([{"prompt": p} for p in PROMPTS])
    args = trl.GRPOConfig(output_dir=str(tmp_path), max_steps=1, per_device_train_batch_size=4, num_generations=4,
                          max_completion_length=6, report_to=[], use_cpu=True)  # fmt: skip
    plain = trl.GRPOTrainer(model, reward, args, data, processing_class=tok)
    assert plain.aux_loss_enabled and plain.router_aux_loss_coef == model.config.router_aux_loss_coef


# ---- the routes through TRL's buffer, and replayed -------------------------------------------------


def watch_training(trainer):
    """Every training forward's micro-batch and what each MoE layer's experts received (top-k ids [B, S, K])."""
    seen, experts = [], {}
    prepare = trainer._prepare_inputs
    trainer._prepare_inputs = lambda batch: seen.append((prepare(batch), experts.copy())) or seen[-1][0]

    def hook_for(pos):
        def hook(module, args):
            if module.training and torch.is_grad_enabled():
                experts[pos] = args[1].detach().clone()

        return hook

    handles = [
        trainer.model.get_submodule(m.name.rpartition(".")[0] + ".experts").register_forward_pre_hook(hook_for(p))
        for p, m in enumerate(trainer.replay.layers)
    ]
    return seen, experts, handles


def full_forward_topk(model, layers, input_ids, mask) -> torch.Tensor:
    """The routers' own top-k over a whole batch in one eval forward: [B, S, L, K]."""
    got = {}
    hooks = [m.router.register_forward_hook(lambda mod, a, o, p=p: got.update({p: o[2]})) for p, m in enumerate(layers)]
    with torch.no_grad():
        model.eval()(input_ids=input_ids, attention_mask=mask)
    model.train()
    for h in hooks:
        h.remove()
    B, S = input_ids.shape
    return torch.stack([got[p].reshape(B, S, -1) for p in range(len(layers))], dim=2)


@pytest.mark.parametrize("replay", ["R3", "R2"])
def test_the_training_forward_gets_the_replayed_experts(replay, tok, tmp_path):
    trainer, _ = trainer_for(tok, tmp_path, "sft", replay=replay, rollout_dtype="bfloat16", num_iterations=2,
                                  max_steps=4)  # fmt: skip
    randomize_routers(trainer.model, seed=5, scale=1.0)  # close scores: bf16 rollouts flip some choices
    seen, _, handles = watch_training(trainer)
    trainer.train()
    key = "rpb_rollout_routes" if replay == "R3" else "rpb_first_routes"
    differed = 0
    for step, (inputs, _) in enumerate(seen[:-1]):
        got = seen[step + 1][1]  # what the experts received in this micro-batch's forward (read at the next)
        routes = inputs[key]
        has = (routes >= 0).all(-1).all(-1)
        for pos in range(routes.shape[2]):
            B, S = has.shape
            received = got[pos].reshape(B, S, -1)
            assert torch.equal(received[has].sort(-1).values, routes[has][:, pos].sort(-1).values), (step, pos)
        differed += int((inputs["rpb_first_routes"] != inputs["rpb_rollout_routes"]).any(-1).any(-1)[has].sum())
    if replay == "R3":
        assert differed > 0, "bf16 rollouts flipped nothing against the fp32 training forward: nothing was shown"
    for h in handles:
        h.remove()


# ---- the anchors' terms, by hand ------------------------------------------------------------------


def one_step(tok, tmp_path, method, **overrides):
    """One GRPO step with the routers moved off the base after the anchor copied it: the routers' inputs and
    gradients, their weights at the start, and the micro-batch the step trained on."""
    trainer, anchor = trainer_for(tok, tmp_path, method, max_steps=1, **overrides)
    base = [m.router.weight.detach().double().clone() for m in trainer.replay.layers]
    move_routers(trainer.model)
    rec = RouterRecorder(trainer.model)
    start = [r.weight.detach().double().clone() for r in rec.routers]
    seen = []
    prepare = trainer._prepare_inputs
    trainer._prepare_inputs = lambda batch: seen.append(prepare(batch)) or seen[-1]
    trainer.train()
    rec.remove()
    anchor.remove()
    trainer.replay.remove()
    return rec, start, base, seen[0]


def completion_weights_T(inputs, loss_type: str) -> torch.Tensor:
    """Each token's weight in GRPO's loss, written from TRL's aggregation (one process, no accumulation)."""
    mask_BC = inputs["completion_mask"].double()
    B = mask_BC.shape[0]
    # grpo: the mean per completion, then over completions; dapo: the batch's completion tokens alike
    w_BC = mask_BC / mask_BC.sum(-1, keepdim=True) / B if loss_type == "grpo" else mask_BC / mask_BC.sum()
    return torch.cat([torch.zeros_like(inputs["prompt_mask"], dtype=torch.float64), w_BC], dim=1).reshape(-1)


@pytest.fixture(scope="module")
def plain_step(tok, tmp_path_factory):
    return {lt: one_step(tok, tmp_path_factory.mktemp(f"plain-{lt}"), "sft", loss_type=lt) for lt in ("dapo", "grpo")}


@pytest.mark.parametrize(
    "method, loss_type",
    [("kl-to-base", "dapo"), ("logit-l2", "dapo"), ("lbl", "dapo"), ("router-l2", "dapo"), ("kl-to-base", "grpo")],
)
def test_the_anchor_term_in_the_router_gradient_is_its_formula(method, loss_type, tok, tmp_path, plain_step):
    rec, start, base, inputs = one_step(tok, tmp_path, method, loss_type=loss_type)
    plain_rec = plain_step[loss_type][0]
    w_T = completion_weights_T(inputs, loss_type)
    L = len(start)
    for pos in range(L) if method == "router-l2" else [L - 1]:
        h_TH = rec.inputs[pos][0]
        assert torch.equal(h_TH, plain_rec.inputs[pos][0])  # the same rollout, the same forward
        if method == "lbl":  # a load over the completion tokens, each weighted as GRPO weighs it
            valid_T = w_T > 0
            assert torch.allclose(w_T[valid_T], w_T[valid_T][0].expand(int(valid_T.sum())))  # dapo: alike
            hand = term_gradient(method, h_TH, start[pos], base[pos], valid_T, TOP_K)
        elif method == "router-l2":
            hand = term_gradient(method, h_TH, start[pos], base[pos], w_T > 0, TOP_K)
        else:  # a per-token term: sum_t w_t x_t, written as the weighted sum of one-token means
            hand = torch.zeros_like(start[pos])
            for t in (w_T > 0).nonzero().squeeze(1).tolist():
                one_T = torch.zeros_like(w_T, dtype=torch.bool)
                one_T[t] = True
                hand += w_T[t] * term_gradient(method, h_TH, start[pos], base[pos], one_T, TOP_K)
        hand = COEF / L * hand
        got = rec.grads[pos][0].double() - plain_rec.grads[pos][0].double()
        assert hand.abs().max() > 1e-4, "a vanishing hand gradient would tell nothing"
        assert (got - hand).abs().max() <= 1e-4 * hand.abs().max(), f"{method} {loss_type} router {pos}"


# ---- the refusals -----------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "overrides, method, expected",
    [
        ({"router_aux_loss_coef": 0.001}, "sft", "router_aux_loss_coef=0.001"),
        ({"replay": "R4"}, "sft", "replay='R4'"),
        ({"replay": "R3", "use_transformers_continuous_batching": True}, "sft", "paged generate_batch"),
        ({"rollout_dtype": "float16"}, "sft", "rollout_dtype='float16'"),
    ],
)
def test_what_the_trainer_refuses_is_named(overrides, method, expected, tok, tmp_path):
    with pytest.raises(ConfigError, match=expected.replace("(", r"\(").replace(")", r"\)")):
        trainer_for(tok, tmp_path, method, **overrides)


def test_an_unknown_loss_type_is_refused_by_name(tok, tmp_path):
    args = grpo_args(tmp_path)
    args.loss_type = "new_loss"  # what a later TRL might add: refused, never scaled as another
    model = build_tiny_model("qwen3_moe", len(tok), seed=0)
    with pytest.raises(ConfigError, match="loss_type='new_loss'"):
        GRPOTrainer(model, reward, args, datasets.Dataset.from_list([{"prompt": "a"}]), processing_class=tok)


def test_rpb_with_r3_is_refused_with_the_reason(tok, tmp_path):
    model = build_tiny_model("qwen3_moe", len(tok), seed=0)
    E, L = model.config.num_experts, len(find_moe_layers(model, get_adapter("qwen3_moe")))
    pi = torch.full((len(PROMPTS), 2, L, E), 1.0 / E)
    anchor = install_anchor(model, AnchorConfig(method="rpb", beta=1.0), prior=pi)
    data = datasets.Dataset.from_list([{"prompt": p} for p in PROMPTS])
    with pytest.raises(ConfigError, match=r"bias-free .*, so replaying them cancels the bias.s effect on selection"):
        GRPOTrainer(model, reward, grpo_args(tmp_path, replay="R3"), data, processing_class=tok, anchor=anchor)
    anchor.remove()


# ---- the monitor and the audit on a GRPO trainer --------------------------------------------------------


def test_the_monitor_counts_the_training_forwards_completion_tokens(tok, tmp_path):
    from rpb.monitor import attach_monitor

    trainer, _ = trainer_for(tok, tmp_path, "kl-to-base", max_steps=2, logging_steps=100, num_iterations=2)
    callback = attach_monitor(trainer)
    seen, _, handles = watch_training(trainer)
    trainer.train()
    for h in handles:
        h.remove()
    # generation and the scoring forwards stay out: the training forwards' completion tokens, counted by hand
    completion_tokens = sum(int(inputs["completion_mask"].sum()) for inputs, _ in seen)
    window = callback.monitor.window.tokens
    assert window.tolist() == [float(completion_tokens)] * len(trainer.replay.layers)


@pytest.mark.parametrize("method", ["kl-to-base", "router-freeze"])
def test_rpb_audit_runs_on_a_grpo_trainer(method, tok, tmp_path):
    from rpb.monitor import audit

    trainer, _ = trainer_for(tok, tmp_path, method, replay="R3")
    before = {n: p.detach().clone() for n, p in trainer.model.named_parameters()}
    report = audit(trainer)
    assert report.contradictions == []
    assert all(layer.aux_grad == 0.0 for layer in report.layers)  # TRL's load-balancing loss: off
    if method == "router-freeze":
        assert all(layer.grad == 0.0 and layer.moved == 0.0 for layer in report.layers)
    else:
        assert report.anchor_reaches and all(layer.anchor_grad > 0 for layer in report.layers)
    assert all(torch.equal(p, before[n]) for n, p in trainer.model.named_parameters())  # left as found


def shipped_grpo_example():
    import importlib.util
    from pathlib import Path

    path = Path(__file__).resolve().parents[3] / "examples" / "trl" / "grpo.py"
    spec = importlib.util.spec_from_file_location("grpo_example", path)
    example = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(example)
    return example


#: each method the shipped example runs on its own prompts, with the options it needs
EXAMPLE_RUNS = {
    "sft": [], "lbl": ["--lbl-coef", "0.1"], "router-l2": ["--lambda", "1"], "kl-to-base": ["--lambda", "1"],
    "logit-l2": ["--lambda", "1"], "router-freeze": [],
    "routing-kd": ["--target", "0.9", "--beta", "0.04", "--replay", "off"],  # the docstring's: a target, no λ
}  # fmt: skip


def test_the_shipped_grpo_example_runs_every_method_it_offers(tmp_path, capsys, save_tiny):
    """One step per method (the anchor's term logged where it has one), two steps of the default, whose second
    update reads the staleness figure; a prior-reading method without its prior, and output-kd, refused by name."""
    example = shipped_grpo_example()
    assert example.main(["--output-dir", str(tmp_path), "--max-steps", "2"]) == 0
    printed = capsys.readouterr().out
    assert "step 1:" in printed and "routing/rollout_override_rate" in printed  # R3's (docs/rl.md)
    assert "step 2:" in printed and "routing/stale_mismatch" in printed  # the batch's second update
    for method, options in EXAMPLE_RUNS.items():
        argv = ["--output-dir", str(tmp_path / method), "--max-steps", "1", "--method", method, *options]
        assert example.main(argv) == 0, method
        printed = capsys.readouterr().out
        assert "step 1:" in printed, method
        assert (f"anchor/{method}" in printed) == (method not in ("sft", "router-freeze")), (method, printed)
        assert ("anchor/lambda" in printed) == (method == "routing-kd"), method  # the target's λ, logged
    with pytest.raises(SystemExit):
        example.main(["--output-dir", str(tmp_path / "rpb"), "--method", "rpb"])
    assert "--method rpb reads a prior: give --prior and --prompts" in capsys.readouterr().err
    # with them: the prompts file labelled by prepare_grpo, its prior collected on a saved model (R2: RPB's bias
    # chooses the first forward's routes, which R3's bias-free rollout routes cannot carry)
    model_dir = save_tiny("qwen3_moe")
    prompts, prior = write_jsonl(conversations(4, seed=3), tmp_path / "prompts.jsonl"), tmp_path / "prior.safetensors"
    collect(str(model_dir), prompts, prior, top_k=TOP_K, max_seq_len=192, progress=False)
    argv = ["--output-dir", str(tmp_path / "rpb"), "--model", str(model_dir), "--dtype", "float32", "--method", "rpb",
            "--prior", str(prior), "--prompts", str(prompts), "--replay", "R2", "--max-steps", "1",
            "--max-completion-length", "8"]  # fmt: skip
    assert example.main(argv) == 0 and "step 1:" in capsys.readouterr().out
    assert example.main(["--output-dir", str(tmp_path / "okd"), "--method", "output-kd", "--lambda", "1"]) == 2
    assert "anchor.method=output-kd in GRPO: TRL's beta is that term" in capsys.readouterr().err
    assert example.main(["--output-dir", str(tmp_path / "kd0"), "--method", "routing-kd", "--lambda", "1"]) == 2
    assert "set beta > 0" in capsys.readouterr().err  # routing-kd reads the reference forward's routing


def test_r2_forces_the_old_log_prob_forward_where_trl_would_skip_it(tok, tmp_path):
    """Accumulation a multiple of the generation cycle: TRL skips its old-log-prob forward; under R2 rpb runs it,
    so every micro-batch carries the first forward's routing and its log-probabilities from the start."""
    trainer, _ = trainer_for(tok, tmp_path, "sft", replay="R2", num_iterations=2, gradient_accumulation_steps=2,
                             steps_per_generation=1, max_steps=1)  # fmt: skip
    assert not trainer._trl_scores_old_logps()
    seen, _, handles = watch_training(trainer)
    trainer.train()
    for h in handles:
        h.remove()
    assert len(seen) == 2
    assert all("rpb_first_routes" in inputs and "old_per_token_logps" in inputs for inputs, _ in seen)


@pytest.mark.parametrize(
    "loss_type, level",
    [*[(lt, "token") for lt in ("grpo", "dr_grpo", "dapo", "bnpo", "cispo", "sapo", "vespo")], ("luspo", "sequence"),
     ("grpo", "sequence")],  # the last: GSPO
)  # fmt: skip
def test_every_supported_loss_type_and_gspo_train_with_an_anchor_and_replay(loss_type, level, tok, tmp_path):
    trainer, anchor = trainer_for(tok, tmp_path, "kl-to-base", replay="R3", loss_type=loss_type,
                                  importance_sampling_level=level, max_steps=2, num_iterations=2)  # fmt: skip
    trainer.train()
    logs = [h for h in trainer.state.log_history if "loss" in h]
    assert len(logs) == 2 and all(torch.isfinite(torch.tensor(h["loss"])) for h in logs)
    anchor.remove()


# ---- precision, and what the config and the trainer refuse ------------------------------------------------


def test_rollout_dtype_under_trls_bf16_default_is_refused_in_the_config(tmp_path):
    """TRL's GRPOConfig defaults bf16=True: training already runs under bfloat16 autocast, so rollout_dtype would
    change nothing; refused where the config is made, not when the trainer is built."""
    with pytest.raises(ConfigError, match=r"rollout_dtype='bfloat16' with bf16=True: the training forwards already"):
        GRPOConfig(output_dir=str(tmp_path), rollout_dtype="bfloat16", use_cpu=True, report_to=[])
    assert grpo_args(tmp_path, rollout_dtype="bfloat16").rollout_dtype == "bfloat16"  # bf16=False: the gap is real


def test_the_precision_is_said_at_construction(tmp_path, caplog, monkeypatch):
    from rpb.integrations.trl import grpo

    monkeypatch.setattr(grpo, "_SAID", set())
    with caplog.at_level("WARNING", logger="rpb.integrations.trl.grpo"):
        bf16 = GRPOConfig(output_dir=str(tmp_path), use_cpu=True, report_to=[])
    said = "generation runs in bfloat16 autocast, the training forwards in bfloat16 autocast"
    assert grpo.precision(bf16) == said and said in caplog.text
    gap = grpo_args(tmp_path, rollout_dtype="bfloat16")
    model_dtype = "the training forwards in the model's dtype"
    assert grpo.precision(gap) == f"generation runs in bfloat16 autocast (rollout_dtype), {model_dtype}"
    assert grpo.precision(grpo_args(tmp_path)) == f"generation runs in the model's dtype, {model_dtype}"


def test_an_anchor_installed_on_another_model_object_is_refused(tok, tmp_path):
    model = build_tiny_model("qwen3_moe", len(tok), seed=0)
    other = build_tiny_model("qwen3_moe", len(tok), seed=0)
    anchor = install_anchor(other, anchor_config("kl-to-base"))
    data = datasets.Dataset.from_list([{"prompt": p} for p in PROMPTS])
    with pytest.raises(ConfigError, match="anchor: installed on another model object than the one given"):
        GRPOTrainer(model, reward, grpo_args(tmp_path), data, processing_class=tok, anchor=anchor)
    anchor.remove()


def test_r2_that_equals_off_says_so(tok, tmp_path, caplog):
    with caplog.at_level("WARNING", logger="rpb.integrations.trl.grpo"):
        trainer_for(tok, tmp_path, "sft", replay="R2")  # num_iterations 1, steps_per_generation = accumulation
    assert "R2 equals 'off' plus one forced forward" in caplog.text
    caplog.clear()
    with caplog.at_level("WARNING", logger="rpb.integrations.trl.grpo"):
        trainer_for(tok, tmp_path, "sft", replay="R2", num_iterations=2)
    assert "R2 equals" not in caplog.text


@pytest.mark.parametrize("bf16", [True, False])
def test_identical_routers_read_overlap_one_and_kl_zero_in_any_precision(bf16, tok, tmp_path):
    """Learning rate 0 on DeepSeek-V3 (sigmoid scores, correction bias, groups), routers of a trained model's temper:
    under TRL's bf16 the monitor's base reference is rounded as the live logits are, so no tie breaks apart."""
    from rpb.monitor import attach_monitor

    trainer, _ = trainer_for(tok, tmp_path, "sft", arch="moonlight", bf16=bf16, learning_rate=0.0, max_steps=2)
    randomize_routers(trainer.model, seed=5, scale=1.0)
    attach_monitor(trainer)
    trainer.train()
    logs = [h for h in trainer.state.log_history if "routing/mean/topk_overlap" in h]
    assert len(logs) == 2
    assert all(h["routing/min/topk_overlap"] == 1.0 and h["routing/max/kl"] == 0.0 for h in logs)


def test_the_forced_r2_forward_gets_every_field_trls_forward_takes(tok, tmp_path, monkeypatch):
    """A vision-language batch carries its images beside the tokens (pixel_values, image_grid_thw, token_type_ids,
    ...): R2's forced first forward must see them as TRL's own forwards do, or its routes and old log-probabilities
    come from a text-only forward. The fields are planted in TRL's batch dict; the test's own wrapper of TRL's
    forward records what each call was handed (and keeps them from this text-only model)."""
    import trl

    trainer, _ = trainer_for(tok, tmp_path, "sft", replay="R2", num_iterations=2, gradient_accumulation_steps=2,
                             steps_per_generation=1, max_steps=1)  # fmt: skip
    assert not trainer._trl_scores_old_logps()  # so rpb forces R2's first forward itself
    generate, forward, handed = (trl.GRPOTrainer._generate_and_score_completions,
                                 trl.GRPOTrainer._get_per_token_logps_and_entropies, [])  # fmt: skip

    def with_images(self, inputs):
        out = generate(self, inputs)
        B = out["prompt_ids"].shape[0]
        out["token_type_ids"] = torch.zeros_like(torch.cat([out["prompt_ids"], out["completion_ids"]], dim=1))
        out["image_grid_thw"] = torch.ones((B, 3), dtype=torch.long)
        return out

    def recording(self, model, input_ids, attention_mask, logits_to_keep, *a, **kw):
        handed.append({k for k, v in kw.items() if v is not None and k in ("token_type_ids", "image_grid_thw")})
        kw = {k: v for k, v in kw.items() if k not in ("token_type_ids", "image_grid_thw")}
        return forward(self, model, input_ids, attention_mask, logits_to_keep, *a, **kw)

    monkeypatch.setattr(trl.GRPOTrainer, "_generate_and_score_completions", with_images)
    monkeypatch.setattr(trl.GRPOTrainer, "_get_per_token_logps_and_entropies", recording)
    trainer.train()
    assert handed and handed[0] == {"token_type_ids", "image_grid_thw"}  # the forced forward, first of all
    assert all(h == {"token_type_ids", "image_grid_thw"} for h in handed)  # and every training forward after it
