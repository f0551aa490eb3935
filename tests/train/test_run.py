"""``rpb train`` end to end on tiny models: every method trains, beta=0 is sft, priors are checked."""

import dataclasses
import json
import shutil

import pytest
import torch
from safetensors.torch import load_file
from transformers import AutoModelForCausalLM, TrainerCallback

from rpb.anchors import METHODS, PriorMismatchError
from rpb.collect import collect
from rpb.errors import ConfigError
from rpb.testing.data import conversations, write_jsonl
from rpb.testing.models import ARCHITECTURES
from rpb.train.config import load_config
from rpb.train.run import deterministic_algorithms, run_training
from tests.conftest import coefficient_overrides, qa, write_rows

ARCHS = ("moonlight", "qwen3_moe", "mixtral")


@pytest.fixture(scope="module")
def setup(tmp_path_factory, save_tiny):
    """Per architecture: a saved tiny model, a data file and the prior collected on them."""
    tmp = tmp_path_factory.mktemp("train")
    data = write_jsonl(conversations(16, seed=5), tmp / "train.jsonl")
    out = {}
    for arch in ARCHS:
        model = save_tiny(arch)
        prior = tmp / f"{arch}.safetensors"
        top_k = ARCHITECTURES[arch][1]["num_experts_per_tok"]
        collect(str(model), data, prior, top_k=top_k, max_seq_len=192, progress=False)
        out[arch] = (model, data, prior)
    return out


def train(setup, arch, tmp_path, method, *overrides, steps=3):
    model, data, prior = setup[arch]
    cfg = load_config(
        None,
        [f"model={model}", f"data_jsonl={data}", f"prior={prior}", f"output_dir={tmp_path / method}",
         f"anchor.method={method}", *coefficient_overrides(method, 0.1, 0.01), f"train.max_steps={steps}",
         "train.batch_size=4", "train.lr=1e-3", "train.log_every=1", *overrides],
    )  # fmt: skip
    return run_training(cfg, progress=False)


def weights(path):
    return load_file(path / "model.safetensors")


@pytest.mark.parametrize("arch", ARCHS)
def test_every_method_trains(setup, arch, tmp_path):
    base = weights(setup[arch][0])
    for method in METHODS:
        out = train(setup, arch, tmp_path, method)
        trained = weights(out)
        assert trained.keys() == base.keys()
        changed = [k for k in base if not torch.equal(base[k], trained[k])]
        assert changed, f"{method}: nothing trained"
        routers = [k for k in base if k.endswith("mlp.gate.weight")]
        if method == "router-freeze":
            assert not set(routers) & set(changed)
        else:
            assert set(routers) <= set(changed), f"{method}: routers must stay trainable"
        logs = [json.loads(line) for line in (out / "log.jsonl").read_text().splitlines()]
        assert all(torch.isfinite(torch.tensor(r["loss"])) for r in logs if "loss" in r)
        if METHODS[method].loss:
            assert any("anchor_loss" in r for r in logs)
        changed_frac = [v for r in logs for k, v in r.items() if k.endswith("bias_changed_fraction")]
        if METHODS[method].needs_prior:
            assert changed_frac and max(changed_frac) > 0
        else:  # a method that reads no prior changes no set: no figure, rather than a 0 that says nothing
            assert changed_frac == [], method
        # a plain HF checkpoint: loads without rpb's hooks or code
        model = AutoModelForCausalLM.from_pretrained(out)
        assert not any(m._forward_hooks for m in model.modules())


@pytest.mark.parametrize("arch", ARCHS)
def test_beta_zero_is_sft_bit_for_bit(setup, arch, tmp_path):
    sft = weights(train(setup, arch, tmp_path, "sft", steps=5))
    zero = weights(train(setup, arch, tmp_path / "b0", "rpb", "anchor.beta=0", steps=5))
    one = weights(train(setup, arch, tmp_path / "b1", "rpb", "anchor.beta=1", steps=5))
    assert all(torch.equal(sft[k], zero[k]) for k in sft)
    assert not all(torch.equal(sft[k], one[k]) for k in sft)


def count_router_calls(monkeypatch):
    """Counts the first router's forward calls in runs started after this (2 per step = recomputed)."""
    import rpb.train.run

    calls = []
    prepare = rpb.train.run.prepare_run

    def counting(cfg, progress=True):
        run = prepare(cfg, progress)
        run.handle.layers[0].moe.router.register_forward_hook(lambda *a: calls.append(1))
        return run

    monkeypatch.setattr(rpb.train.run, "prepare_run", counting)
    return calls


def test_gradient_checkpointing_run_matches(setup, tmp_path, monkeypatch):
    calls = count_router_calls(monkeypatch)
    off = "train.calibrate_rows=0"  # its forwards before the first step would count too
    plain = weights(train(setup, "moonlight", tmp_path / "a", "rpb", off))
    assert len(calls) == 3  # one forward per step
    ckpt = weights(train(setup, "moonlight", tmp_path / "b", "rpb", off, "train.gradient_checkpointing=true"))
    assert len(calls) == 3 + 6  # forward and recomputation in each of the 3 steps
    assert max(float((plain[k] - ckpt[k]).abs().max()) for k in plain) <= 1e-6


def test_mismatched_priors_are_refused_naming_each_field(setup, tmp_path, save_tiny):
    model, data, prior = setup["moonlight"]
    other_data = write_jsonl(conversations(16, seed=6), tmp_path / "other.jsonl")
    with pytest.raises(PriorMismatchError) as err:
        train({"moonlight": (model, other_data, prior)}, "moonlight", tmp_path, "rpb")
    assert "data_sha256" in str(err.value) and "num_rows" not in str(err.value)
    _, _, qwen_prior = setup["qwen3_moe"]
    with pytest.raises(PriorMismatchError) as err:
        train({"moonlight": (model, data, qwen_prior)}, "moonlight", tmp_path, "rpb")
    text = str(err.value)
    for field in ("model", "routers_sha256"):
        assert f"  {field}: the prior has" in text
    # the same weights with another top-k in the config
    other_k = tmp_path / "top4"
    shutil.copytree(model, other_k)
    cfg = json.loads((other_k / "config.json").read_text())
    cfg["num_experts_per_tok"] = 4
    (other_k / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(PriorMismatchError) as err:
        train({"moonlight": (other_k, data, prior)}, "moonlight", tmp_path, "rpb")
    assert "  top_k: the prior has 2, this run has 4" in str(err.value)
    assert "routers_sha256" not in str(err.value)  # the same routers: only top-k differs


def test_config_errors_are_listed_together(tmp_path):
    with pytest.raises(ConfigError) as err:
        load_config(None, ["anchor.method=kl-to-base", "anchor.bogus=1", "train.lr=0", "train.loss_on=some"])
    text = str(err.value)
    for needle in ("model: required", "anchor.bogus: unknown key", "anchor.lambda: required", "train.lr", "loss_on"):
        assert needle in text
    with pytest.raises(ConfigError, match=r"prior: required by anchor\.method 'rpb'"):
        load_config(None, ["model=m", f"data_jsonl={tmp_path}", "output_dir=o", "anchor.method=rpb"])


def test_deterministic_flag_holds_for_the_run_only(setup, tmp_path):
    seen = []

    class Record(TrainerCallback):
        def on_step_end(self, args, state, control, **kwargs):
            seen.append(torch.are_deterministic_algorithms_enabled())

    model, data, prior = setup["moonlight"]
    for flag in (True, False):
        cfg = load_config(None, [f"model={model}", f"data_jsonl={data}", f"prior={prior}", "train.max_steps=2",
                                 f"output_dir={tmp_path / str(flag)}", f"train.deterministic={str(flag).lower()}",
                                 "train.batch_size=4", "train.save=false"])  # fmt: skip
        run_training(cfg, progress=False, callbacks=[Record()])
        assert not torch.are_deterministic_algorithms_enabled()
    assert seen == [True, True, False, False]


def test_deterministic_kernels_repeat_the_toy_world_backward_exactly():
    """At the toy world's size the default CPU backward is not repeatable (index_put_ accumulates
    in thread order: 44 of 52 gradients differed on 2 cores); inside the block
    every gradient repeats bit for bit, and the caller's setting comes back afterwards."""
    from rpb.testing.models import tiny_config
    from rpb.toyworld.world.base import BaseRecipe

    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(tiny_config("moonlight", 96, **BaseRecipe().model_overrides()))
    model.train()
    ids = torch.randint(3, 96, (32, 96), generator=torch.Generator().manual_seed(1))

    def grads():
        model.zero_grad()
        model(input_ids=ids, labels=ids).loss.backward()
        return [p.grad.clone() for p in model.parameters() if p.grad is not None]

    with deterministic_algorithms(True):
        assert torch.are_deterministic_algorithms_enabled()
        first, second = grads(), grads()
    assert not torch.are_deterministic_algorithms_enabled()
    assert all(torch.equal(a, b) for a, b in zip(first, second, strict=True))


def test_the_callers_config_and_process_group_are_left_as_they_were(setup, tmp_path):
    """run_training resolves kl-to-base's transform from the prior into a copy (rpb_run.json records it),
    and a process group the caller made stays up after the run: only one the Trainer starts is ended."""
    model, data, prior = setup["moonlight"]
    cfg = load_config(
        None,
        [f"model={model}", f"data_jsonl={data}", f"prior={prior}", f"output_dir={tmp_path}", "anchor.method=kl-to-base",
         "anchor.lambda=0.1", "train.max_steps=1", "train.batch_size=4"],
    )  # fmt: skip
    before = dataclasses.replace(cfg.anchor)
    dist = torch.distributed
    assert not dist.is_initialized()
    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'store'}", rank=0, world_size=1)
    try:
        run_training(cfg, progress=False)
        assert dist.is_initialized(), "the caller's process group was destroyed"
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()
    assert cfg.anchor == before and cfg.anchor.router_transform is None
    record = json.loads((tmp_path / "rpb_run.json").read_text())
    assert record["router_transform"] == "softmax" and record["config"]["anchor"]["router_transform"] is None
    assert record["prior_kind"] == "probability"  # the kind the prior says (rpb collect --from-routes: frequency)


def test_the_run_measures_its_own_displacement_before_the_first_step(setup, tmp_path, caplog):
    """log.jsonl opens with calibrate/displacement: rpb calibrate's counterfactual at the run's beta, on
    the same rows (all 16 here), measured by the anchor about to train; a warning above the limit."""
    from rpb.calibrate import calibrate

    model, data, prior = setup["moonlight"]
    out = train(setup, "moonlight", tmp_path, "rpb", "train.displacement_warn=0.0", steps=1)
    first = json.loads((out / "log.jsonl").read_text().splitlines()[0])
    report = calibrate(str(model), prior, data, betas=[1.0], rows=16, progress=False)
    assert first["step"] == 0
    assert first["calibrate/displacement"] == pytest.approx(
        report["displacement_counterfactual"]["mean"]["1"]["both"], abs=1e-5
    )
    for i, layer in enumerate(report["moe_layers"]):
        expected = report["displacement_counterfactual"]["layers"]["1"]["both"][i]
        assert first[f"calibrate/displacement/layer{layer}"] == pytest.approx(expected, abs=1e-5)
    assert "moves" in caplog.text and "displacement_warn=0" in caplog.text
    quiet = train(setup, "moonlight", tmp_path / "off", "rpb", "train.calibrate_rows=0", steps=1)
    assert "calibrate/displacement" not in (quiet / "log.jsonl").read_text()


def test_routing_figures_reach_tensorboard(setup, tmp_path):
    """report_to=tensorboard: the event files hold the per-layer figures log.jsonl holds."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    out = train(setup, "qwen3_moe", tmp_path, "kl-to-base", "train.report_to=[tensorboard]", steps=2)
    events = sorted(out.rglob("events.out.tfevents.*"))
    assert events
    acc = EventAccumulator(str(events[0].parent))
    acc.Reload()
    tags = set(acc.Tags()["scalars"])
    logs = [json.loads(line) for line in (out / "log.jsonl").read_text().splitlines()]
    logged = [r for r in logs if "moe/layer_1/load_cv" in r]
    assert len(logged) == 2
    for name in ("moe/layer_1/load_cv", "moe/mean/dead_experts", "moe/layer_2/base_topk_overlap_current_hidden",
                 "moe/mean/anchor_loss"):  # fmt: skip
        tag = next(t for t in tags if t.endswith(name))
        assert [e.value for e in acc.Scalars(tag)] == pytest.approx([r[name] for r in logged], abs=1e-5)


def test_rows_cut_by_max_seq_len_are_counted_in_the_log_and_in_rpb_run_json(save_tiny, tmp_path, caplog):
    """Rows built longer than train.max_seq_len (their rendered tokens counted through the tokenizer's own
    template): the run says how many it cut, and rpb_run.json records it."""
    from rpb.models import load_tokenizer

    model = save_tiny("moonlight")
    short = [qa("What is 1 + 1?", "2"), qa("Name a colour.", "Blue."), qa("Hi", "Hello")]
    long = [qa("Say it often.", "again and again " * 40), qa("Count.", " ".join(str(i) for i in range(80)))]
    tok = load_tokenizer(str(model))
    tokens = [len(tok(tok.apply_chat_template(r["messages"], tokenize=False), add_special_tokens=False)["input_ids"])
              for r in (*short, *long)]  # fmt: skip
    assert max(tokens[:3]) < 128 < min(tokens[3:])
    data = write_rows(tmp_path / "rows.jsonl", [short[0], long[0], short[1], long[1], short[2]])
    cfg = load_config(None, [f"model={model}", f"data_jsonl={data}", f"output_dir={tmp_path / 'run'}",
                             "anchor.method=sft", "train.max_seq_len=128", "train.max_steps=1", "train.batch_size=5",
                             "train.calibrate_rows=0"])  # fmt: skip
    with caplog.at_level("WARNING"):
        out = run_training(cfg, progress=False)
    assert json.loads((out / "rpb_run.json").read_text()).get("truncated_rows") == 2
    assert "2 of 5 row(s) are longer than max_seq_len=128 tokens" in caplog.text
