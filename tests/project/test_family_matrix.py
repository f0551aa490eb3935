"""The family matrix: the routing monitor, ``rpb audit``, expert training and the revert test on every real-config
replica (``rpb.testing.REPLICAS``; a replica added to its registry runs here too, none skipped).

Each check is read against something computed apart from the code under test: the monitor's figures against
the router's own logits and selection and the family's hand-written rule (tests/test_routing.py); the audit
against what the set-up is known to do; expert training against the parameters' values before and after.
The replicas are the session's (``replica`` fixture, shared with tests/adapters/test_hf_replicas.py)."""

from __future__ import annotations

import dataclasses
import json
import re

import pytest
import torch
from transformers import Trainer, TrainingArguments

from rpb.adapters import find_moe_layers, get_adapter
from rpb.adapters.fingerprint import router_tensors
from rpb.collect import collect
from rpb.collect.from_routes import collect_from_routes
from rpb.collect.hf_routes import write_routes
from rpb.data import AnchorCollator, load_labelled
from rpb.experts import read_choice, train_only_experts
from rpb.experts.run import run_experts
from rpb.models import load_causal_lm, load_tokenizer
from rpb.monitor import MonitorConfig, RoutingMonitor, audit
from rpb.prior.artifact import load_artifact
from rpb.retention.revert import BASE, POST, REVERTED, Pair, measure_domain
from rpb.retention.revert_run import load_pair, run_revert
from rpb.testing.data import conversations, write_jsonl
from rpb.testing.replicas import REPLICAS, published, routing_part
from rpb.train.audit import run_audit
from rpb.train.lora import LoraSection, apply_lora
from tests.collect.test_from_routes import hand_frequency
from tests.test_routing import reference_route

pytestmark = pytest.mark.usefixtures("one_thread")

#: a routed expert's parameter: ``layers.<i>.<block>.experts.<rest>`` (shared experts are ``shared_expert(s)``)
ROUTED = re.compile(r"layers\.(\d+)\.[a-z_]+\.experts\.")
SHARED = re.compile(r"\.shared_experts?(_gate)?[.]")
#: every row whole under each vendor's template (gpt-oss's system header alone is about 250 tokens)
MAX_LEN = 512


@pytest.fixture(scope="module")
def family(replica, tmp_path_factory):
    """family(name) -> (model_dir, data, prior, top_k): one data file and one prior per family, made once."""
    cache = {}

    def make(name):
        if name not in cache:
            tmp = tmp_path_factory.mktemp(f"matrix-{name}")
            model_dir = replica(name)
            data = write_jsonl(conversations(6, seed=5), tmp / "train.jsonl")
            top_k = routing_part(published(name))["num_experts_per_tok"]
            collect(str(model_dir), data, tmp / "prior.safetensors", top_k=top_k, max_seq_len=MAX_LEN, progress=False)
            cache[name] = model_dir, data, tmp / "prior.safetensors", top_k
        return cache[name]

    return make


def batch_of(model_dir, data, rows=4) -> dict:
    examples = load_labelled(str(data), load_tokenizer(str(model_dir)), MAX_LEN).examples[:rows]
    return AnchorCollator(pad_id=0)([{"input_ids": e.input_ids, "labels": e.input_ids, "span_ids": e.span_ids,
                                      "sample_index": e.index} for e in examples])  # fmt: skip


# ---- the monitor ---------------------------------------------------------------------------------------------


def hand_kl(base_TE: torch.Tensor, now_TE: torch.Tensor, sigmoid: bool) -> torch.Tensor:
    """KL(base || now) per token of the family's transform: softmax, or the sigmoid normalised to sum 1."""

    def probs(z):
        z = z.double()
        if sigmoid:
            s = torch.sigmoid(z)
            return s / s.sum(-1, keepdim=True)
        return torch.softmax(z, -1)

    p, q = probs(base_TE), probs(now_TE)
    return (p * (p.log() - q.log())).sum(-1)


@pytest.mark.parametrize("name", REPLICAS)
def test_the_monitor_reads_moved_routers_as_a_hand_computation(name, family):
    model_dir, data, _, top_k = family(name)
    model = load_causal_lm(str(model_dir)).train()
    facts = get_adapter(model.config.model_type)
    layers = find_moe_layers(model, facts)
    monitor = RoutingMonitor(model, MonitorConfig(per_layer=True)).attach()
    base_W = [m.router.weight.detach().clone() for m in layers]
    gen = torch.Generator().manual_seed(11)
    with torch.no_grad():  # a known move: about half the routers' own scale
        for m in layers:
            w = m.router.weight
            w.add_(torch.randn(w.shape, generator=gen) * 2.0 / w.shape[1] ** 0.5)
    seen = {}

    def keep(pos):
        def hook(module, args, out):  # returns None: the router's output goes on unchanged
            seen[pos] = args, out

        return hook

    hooks = [m.router.register_forward_hook(keep(pos)) for pos, m in enumerate(layers)]
    batch = batch_of(model_dir, data)
    labels = batch["input_ids"].clone()
    labels[:, :5] = -100  # the monitor counts the loss tokens only
    labels[batch["attention_mask"] == 0] = -100
    with torch.no_grad():
        model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"], labels=labels)
    for h in hooks:
        h.remove()
    figures = monitor.flush()
    monitor.remove()
    keep_T = (labels != -100).reshape(-1)
    sigmoid = facts.score_function == "sigmoid"
    for pos, m in enumerate(layers):
        args, out = seen[pos]
        hidden_TH = args[0].reshape(-1, args[0].shape[-1])[keep_T].float()
        base_TE = torch.nn.functional.linear(hidden_TH, base_W[pos], getattr(m.router, "bias", None))
        now_TE = out[0].reshape(keep_T.shape[0], -1)[keep_T]
        ids_now_TK = out[2].reshape(keep_T.shape[0], -1)[keep_T]  # the router's own selection
        block_bias = args[1] if len(args) > 1 else None  # MiniMax-M2's block hands its router the bias
        ids_base_TK, _ = reference_route(m.router, base_TE, torch.zeros_like(now_TE), block_bias)
        overlap = (ids_now_TK[:, :, None] == ids_base_TK[:, None, :]).any(-1).sum(-1).double().mean() / top_k
        kl = hand_kl(base_TE, now_TE, sigmoid).mean()
        i = m.layer_index
        assert 0.0 < overlap < 1.0, f"{name} layer {i}: the move should change some choices, not all"
        assert figures[f"routing/layer_{i}/topk_overlap"] == pytest.approx(float(overlap), abs=1e-9)
        assert figures[f"routing/layer_{i}/kl"] == pytest.approx(float(kl), rel=1e-4, abs=1e-7)


# ---- priors from an engine's routes ------------------------------------------------------------------------


@pytest.mark.parametrize("name", REPLICAS)
def test_routes_in_vllms_layout_give_the_hand_frequency_prior(name, family, tmp_path):
    """The mechanics of a frequency prior (random weights say nothing of its quality): routes written in vLLM's
    layout (rpb routes) and read back (rpb collect --from-routes) give, per row, span, layer and expert, the share
    of the span's tokens that the family's hand-written rule chose it for, over top-k; the probability prior of
    the same rows has the same rows and spans, and every row of both sums to 1."""
    model_dir, data, prior_path, top_k = family(name)
    write_routes(str(model_dir), data, tmp_path / "routes.safetensors", MAX_LEN, batch_size=1)
    freq = collect_from_routes(
        str(model_dir), data, tmp_path / "routes.safetensors", tmp_path / "freq.safetensors", MAX_LEN, progress=False
    )
    assert torch.allclose(freq.prior_qa.double(), hand_frequency(model_dir, data, MAX_LEN), atol=1e-6), name
    prob = load_artifact(prior_path)
    assert torch.equal(freq.span_tokens, prob.span_tokens) and freq.metadata["top_k"] == top_k
    for key in ("moe_layers", "num_experts", "routers_sha256", "data_sha256"):
        assert freq.metadata[key] == prob.metadata[key], (name, key)
    for art in (freq, prob):
        assert torch.allclose(art.prior_qa.sum(-1), torch.ones(art.prior_qa.shape[:3]), atol=1e-5), name


# ---- rpb audit -------------------------------------------------------------------------------------------------


class Rows(torch.utils.data.Dataset):
    """Token rows for a plain Hugging Face Trainer (the audit of a set-up rpb did not build)."""

    def __init__(self, batch: dict):
        self.batch = batch

    def __len__(self):
        return self.batch["input_ids"].shape[0]

    def __getitem__(self, i):
        ids, mask = self.batch["input_ids"][i], self.batch["attention_mask"][i]
        return {"input_ids": ids, "attention_mask": mask, "labels": ids.masked_fill(mask == 0, -100)}


def moved_by_a_hook(module, args):
    """A user's hook that moves a router it froze, at every forward (before it runs: in place after would
    break backward)."""
    with torch.no_grad():
        module.weight.add_(1e-3)


@pytest.mark.parametrize("name", REPLICAS)
def test_the_audit_is_quiet_on_correct_set_ups_and_catches_a_moved_frozen_router(name, family, tmp_path):
    model_dir, data, prior, _ = family(name)
    common = [f"model={model_dir}", f"data_jsonl={data}", f"output_dir={tmp_path / 'run'}", "train.calibrate_rows=0",
              "train.batch_size=4", f"train.max_seq_len={MAX_LEN}"]  # fmt: skip
    rpb = run_audit(None, [*common, f"prior={prior}", "anchor.method=rpb", "anchor.beta=4.0"])
    assert rpb.contradictions == [] and rpb.asked.router == "free"
    assert all(a.grad > 0 and a.biased > 0 for a in rpb.layers), "rpb trains the routers and biases selection"
    # docs' kl-to-base (lambda 0.1) one small step from the base: a millionth of the LM gradient, and working
    kl = run_audit(None, [*common, "anchor.method=kl-to-base", "anchor.lambda=0.1", "train.lr=1e-6"])
    assert kl.contradictions == [] and kl.anchor_reaches

    model = load_causal_lm(str(model_dir))
    layers = find_moe_layers(model, get_adapter(model.config.model_type))
    choice = tmp_path / "experts.json"
    choice.write_text(json.dumps({"experts": {str(m.layer_index): [0, 1] for m in layers}}))
    sft = run_audit(None, [*common, "anchor.method=sft", f"train.only_experts={choice}"])
    assert sft.contradictions == [] and sft.asked.router == "frozen"
    assert all(a.moved == 0 for a in sft.layers)

    for m in layers:  # frozen by hand, then moved by the user's own hook
        for p in m.router.parameters():
            p.requires_grad_(False)
        m.router.register_forward_pre_hook(moved_by_a_hook)
    args = TrainingArguments(output_dir=str(tmp_path / "hf"), max_steps=2, per_device_train_batch_size=4,
                             learning_rate=1e-2, report_to=[], save_strategy="no", use_cpu=True, disable_tqdm=True,
                             remove_unused_columns=False)  # fmt: skip
    caught = audit(Trainer(model=model, args=args, train_dataset=Rows(batch_of(model_dir, data))))
    assert caught.asked.router == "frozen"
    assert [c.split(" (")[0] for c in caught.contradictions] == ["router frozen asked, router changed"]


# ---- expert training -------------------------------------------------------------------------------------------


def expert_slices(model, num_experts: int):
    """``{(param name, layer): tensor}`` of every routed expert's parameter (fused ``[E, ...]``)."""
    out = {}
    for n, p in model.named_parameters():
        match = ROUTED.search(n.replace("base_layer.", ""))
        if match and p.shape[0] == num_experts:
            out[n] = (int(match.group(1)), p)
    return out


@pytest.mark.parametrize("name", REPLICAS)
def test_expert_training_moves_the_chosen_experts_alone(name, family, tmp_path):
    model_dir, data, prior, _ = family(name)
    path = tmp_path / "experts.json"
    # chosen by the token measure on the training rows: every chosen expert gets tokens, so a gradient
    run_experts(str(prior), str(path), measure="token", top_n=2, model=str(model_dir), data_jsonl=str(data),
                shared_experts=True, progress=False)  # fmt: skip
    choice = read_choice(path)
    batch = batch_of(model_dir, data, rows=6)
    inputs = {"input_ids": batch["input_ids"], "attention_mask": batch["attention_mask"],
              "labels": batch["input_ids"].masked_fill(batch["attention_mask"] == 0, -100)}  # fmt: skip

    # the file's flags both ways under full fine-tuning: shared experts (and their gates) with the routed ones,
    # or the non-expert modules (routers included) without the shared experts
    flipped = dataclasses.replace(choice, shared_experts=False, non_expert_modules=True)
    for how, flags in (("full", choice), ("full", flipped), ("lora", choice)):
        model = load_causal_lm(str(model_dir)).train()
        facts = get_adapter(model.config.model_type)
        layers = find_moe_layers(model, facts)
        E = int(layers[0].router.weight.shape[0])
        routers = {id(p) for m in layers for p in m.router.parameters()}
        before = {n: p.detach().clone() for n, p in model.named_parameters()}
        if how == "full":
            train_only_experts(model, flags, facts)
            run = model
        else:
            run = apply_lora(model, LoraSection(rank=2, attention=False, experts={"from": str(path)}), facts)
        optimizer = torch.optim.AdamW([p for p in run.parameters() if p.requires_grad], lr=1e-2, weight_decay=0.0)
        grads, pushed = {}, set()  # the first step's gradients; what any step gave a nonzero gradient
        for step in range(2):
            optimizer.zero_grad()
            run(**inputs).loss.backward()
            if step == 0:
                grads = {n: p.grad.clone() for n, p in run.named_parameters() if p.grad is not None}
            pushed |= {n for n, p in run.named_parameters() if p.grad is not None and p.grad.abs().sum() > 0}
            optimizer.step()
        if how == "lora":
            run = run.merge_and_unload()
        after = dict(run.named_parameters())
        routed = expert_slices(run, E)
        assert routed, f"{name}: no routed expert parameter found"
        for n, (layer, p) in routed.items():
            keep_E = choice.mask(layer, E)
            for e in range(E):
                if not keep_E[e]:
                    assert torch.equal(p[e], before[n][e]), f"{name} {how}: unchosen expert {e} of {n} moved"
        for layer, ids in choice.experts.items():
            # full fine-tuning trains every parameter of a chosen expert (gpt-oss's biases too); LoRA its weights
            trained = [(n, p) for n, (lay, p) in routed.items() if lay == layer]
            weights = [(n, p) for n, p in trained if how == "full" or n.endswith("proj")]
            for e in ids:
                if how == "full":
                    no_grad = [n for n, _ in weights if n not in grads or not grads[n][e].abs().sum() > 0]
                    assert no_grad == [], f"{name}: chosen expert {layer}/{e} got no gradient in {no_grad}"
                else:
                    assert any(not torch.equal(p[e], before[n][e]) for n, p in weights), f"{name}: {layer}/{e} still"
        for n, p in after.items():
            if n in routed:
                continue
            moved = not torch.equal(p, before[n])
            shared = bool(SHARED.search(f".{n}"))
            # full fine-tuning: shared experts and their gates train when the file says so, the non-expert
            # modules (those a gradient reaches) when it says so; LoRA on experts alone leaves every other weight
            expected = how == "full" and ((shared and flags.shared_experts) or (
                not shared and flags.non_expert_modules and n in pushed))  # fmt: skip
            assert moved == expected, f"{name} {how} {flags.shared_experts=} {flags.non_expert_modules=}: {n} {moved=}"
            if id(p) in routers and how == "full":
                assert moved == flags.non_expert_modules, f"{name}: router {n} moved={moved}"


# ---- the revert test (rpb retention --revert-routers) -----------------------------------------------------------


@pytest.mark.parametrize("name", REPLICAS)
def test_the_revert_puts_the_base_routers_back_and_nothing_else(name, family, tmp_path):
    """A post model trained a few steps in its routers and routed experts: inside the revert each router tensor is
    the base's bit for bit and every other entry the post model's, the post model is itself after, and its
    routing's overlap to the base rises (the first MoE layer's, whose input nothing trained moved, back to 1); a
    post moved by hand in its routers alone gives the base's figures exactly.

    Attention and embeddings stay frozen here on purpose: trained with them (AdamW, 3 steps at 1e-3 to 3e-2) the
    random replicas' hidden states move so far that the base's routers bring no overlap back on most families.
    That is a fact about these replicas, not a check of the revert: the toy world's grid measures real drift."""
    model_dir, data, _, _ = family(name)
    post = load_causal_lm(str(model_dir)).train()
    facts = get_adapter(post.config.model_type)
    routers = {t.data_ptr() for m in find_moe_layers(post, facts) for t in router_tensors(m, facts).values()}
    trained = [p for n, p in post.named_parameters() if p.data_ptr() in routers or ROUTED.search(n)]
    for p in post.parameters():
        p.requires_grad_(any(p is q for q in trained))
    batch = batch_of(model_dir, data)
    optimizer = torch.optim.AdamW(trained, lr=1e-2, weight_decay=0.0)
    for _ in range(3):
        optimizer.zero_grad()
        post(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"],
             labels=batch["input_ids"].masked_fill(batch["attention_mask"] == 0, -100)).loss.backward()  # fmt: skip
        optimizer.step()
    post.save_pretrained(tmp_path / "post")
    sets = {"train": data}
    # with greedy decoding too (a few tokens): MiniMax-M2's config asks transformers for a drafting it cannot load
    report = run_revert(str(model_dir), str(tmp_path / "post"), sets, tmp_path / "out", max_seq_len=MAX_LEN,
                        generate=True, max_new_tokens=2, progress=False)  # fmt: skip
    variants = report["sets"]["train"]["variants"]
    assert all(0.0 <= f["exact_match"] <= 1.0 for f in variants.values())
    overlap = {v: f["topk_overlap"]["all"] for v, f in variants.items()}
    assert overlap["post"] < 1.0 and overlap["post+base routers"] > overlap["post"], (name, overlap)
    assert variants["post+base routers"]["topk_overlap_by_layer"][0] == 1.0, name

    pair = load_pair(str(model_dir), str(tmp_path / "post"), "float32", "cpu", False)
    before = {k: v.clone() for k, v in pair.post.state_dict().items()}
    with pair.running(REVERTED) as (model, layers):
        names = set()
        for b, p in zip(pair.base_layers, layers, strict=True):
            for tensor_name, t in router_tensors(p, facts).items():
                assert torch.equal(t, router_tensors(b, facts)[tensor_name].to(t.dtype)), (name, p.name, tensor_name)
                names.add(t.data_ptr())
        now = model.state_dict()
        others = [k for k, v in now.items() if v.data_ptr() not in names]
        assert others and all(torch.equal(now[k], before[k]) for k in others), name
        assert any(not torch.equal(now[k], before[k]) for k in now), f"{name}: the routers moved"
    assert all(torch.equal(pair.post.state_dict()[k], v) for k, v in before.items()), f"{name}: restored"

    moved = load_causal_lm(str(model_dir)).eval()
    gen = torch.Generator().manual_seed(7)
    with torch.no_grad():
        for m in find_moe_layers(moved, facts):
            for t in router_tensors(m, facts).values():
                t.add_(torch.randn(t.shape, generator=gen).to(t.dtype) * 0.5)
    by_hand = Pair(pair.base, moved, pair.base_layers, find_moe_layers(moved, facts), facts)
    examples = load_labelled(str(data), load_tokenizer(str(model_dir)), MAX_LEN).examples
    figures = measure_domain(by_hand, examples, (POST, REVERTED, BASE), 3, 0)
    assert figures[REVERTED].nll_rows == figures[BASE].nll_rows, name
    assert (
        figures[REVERTED].summary()["topk_overlap"]["all"] == 1.0 and figures[POST].nll_rows != figures[BASE].nll_rows
    )
