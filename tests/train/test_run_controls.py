"""``rpb train`` under the shuffled-prior controls: every step chooses what the hand selection chooses on the
prior shuffled by hand with the permutation the run records, pi'[x, s, l, sigma_l(e)] = pi[x, s, l, e].

The tiny Qwen3-MoE (softmax, then top-k) trains one step per control; a forward hook registered after the
anchor's reads each router's logits and chosen experts. The expected choice is written out here: soft
controls take the top-k of softmax(z + beta * b) with b = eq. 3 of the shuffled row (``tests.hand_routing``),
hard ones the top-k of the shuffled row itself; structural and padding tokens keep softmax(z)'s top-k.
"""

from __future__ import annotations

import json
from contextlib import contextmanager

import pytest
import torch

import rpb.anchors.prior_routing
import rpb.train.run
from rpb.collect import collect
from rpb.prior.artifact import load_artifact
from rpb.testing.data import conversations, write_jsonl
from rpb.testing.models import ARCHITECTURES
from rpb.train.config import load_config
from rpb.train.run import run_training
from tests.hand_routing import hand_select, token_bias

pytestmark = pytest.mark.usefixtures("one_thread")

ARCH = "qwen3_moe"
TOP_K = ARCHITECTURES[ARCH][1]["num_experts_per_tok"]
SOFT = ("within-soft", "within-transition-soft")
HARD = ("within-hard", "global-hard", "within-transition-hard")
CONTROLS = SOFT + HARD
#: the shuffle each control records (the methods table, written out)
MODES = {"within-soft": "within", "within-hard": "within", "global-hard": "global",
         "within-transition-soft": "within-transition", "within-transition-hard": "within-transition"}  # fmt: skip
#: a seed under which no layer's permutation is an involution (checked below), so sigma and its inverse
#: shuffle differently; seed 1, for one, gives global-hard an involution in layer 0
SHUFFLE_SEED = 3
BETA = 1.0


@pytest.fixture(scope="module")
def setup(tmp_path_factory, save_tiny):
    """One tiny model, a data file (answers of several tokens: the transition graph needs consecutive
    answer tokens) and the prior collected on them, shared by every run of this file."""
    tmp = tmp_path_factory.mktemp("controls")
    data = write_jsonl(conversations(16, seed=5), tmp / "train.jsonl")
    model = save_tiny(ARCH)
    prior = tmp / "prior.safetensors"
    collect(str(model), data, prior, top_k=TOP_K, max_seq_len=192, progress=False)
    return model, data, prior, load_artifact(prior).prior_qa.clone()


@contextmanager
def recording_run(monkeypatch):
    """Every training forward of runs started inside: its batch's keys and, per router, (logits, chosen
    sets) as the anchor's hook left them. With one step the first batch collated is the one trained on."""
    seen = {"batches": [], "forwards": []}
    prepare = rpb.train.run.prepare_run

    def recording(cfg, progress=True):
        run = prepare(cfg, progress)
        collate, routers = run.collator, [layer.moe.router for layer in run.handle.layers]

        def keep_batch(features):
            batch = collate(features)
            seen["batches"].append({k: batch[k].clone() for k in ("rpb_sample_index", "rpb_span", "attention_mask")})
            return batch

        def hook(module, args, out):
            if module.training:
                if not seen["forwards"] or len(seen["forwards"][-1]) == len(routers):
                    seen["forwards"].append([])
                seen["forwards"][-1].append((out[0].detach().clone(), [frozenset(r) for r in out[2].tolist()]))

        run.collator = keep_batch
        for router in routers:  # after the anchor's hook: sees the selection it made
            router.register_forward_hook(hook)
        return run

    with monkeypatch.context() as m:
        m.setattr(rpb.train.run, "prepare_run", recording)
        yield seen


def train_control(setup, tmp_path, method, monkeypatch) -> tuple[dict, dict]:
    """One step of ``rpb train`` under ``method``: (what the hooks saw, rpb_run.json)."""
    model, data, prior, _ = setup
    cfg = load_config(
        None,
        [f"model={model}", f"data_jsonl={data}", f"prior={prior}", f"output_dir={tmp_path / method}",
         f"anchor.method={method}", f"anchor.shuffle_seed={SHUFFLE_SEED}", f"anchor.beta={BETA}",
         "train.max_steps=1", "train.batch_size=4", "train.lr=1e-3", "train.calibrate_rows=0", "train.save=false"],
    )  # fmt: skip
    with recording_run(monkeypatch) as seen:
        out = run_training(cfg, progress=False)
    return seen, json.loads((out / "rpb_run.json").read_text())


def shuffle_by_hand(pi_NSLE: torch.Tensor, sigma_LE: list[list[int]]) -> torch.Tensor:
    """pi'[..., l, sigma_l(e)] = pi[..., l, e], one (layer, expert) at a time."""
    out_NSLE = torch.full_like(pi_NSLE, float("nan"))
    for layer, row in enumerate(sigma_LE):
        for e, target in enumerate(row):
            out_NSLE[:, :, layer, target] = pi_NSLE[:, :, layer, e]
    return out_NSLE


def hand_choice(method, pi_NSLE, layer, z_TE, sample_T, span_T, valid_T) -> list[frozenset]:
    """The expected expert sets of one router: content tokens (valid, span Q or A) follow the shuffled prior,
    the rest keep the native softmax top-k."""
    content_T = valid_T & (span_T >= 0) & (sample_T >= 0)
    sample_T, span_T = torch.where(content_T, sample_T, -1), torch.where(content_T, span_T, -1)
    if method in SOFT:
        return hand_select(z_TE, token_bias(pi_NSLE, layer, sample_T, span_T, BETA), TOP_K)
    native = hand_select(z_TE, torch.zeros_like(z_TE), TOP_K)
    forced = []
    for t, (x, s) in enumerate(zip(sample_T.tolist(), span_T.tolist(), strict=True)):
        if x < 0:
            forced.append(native[t])
            continue
        row_E = pi_NSLE[x, s, layer]
        top_E = row_E.sort(descending=True).values
        assert top_E[TOP_K - 1] > top_E[TOP_K], f"tied prior row {x, s, layer}: its top-{TOP_K} is not defined"
        forced.append(frozenset(row_E.topk(TOP_K).indices.tolist()))
    return forced


def check_control(method, seen, record, pi_NSLE):
    """The run's permutation is one per layer (inside the recorded communities for within-*), and every
    router of the step chose what the hand selection on the prior shuffled with it chooses."""
    sigma_LE = record["shuffle"]["sigma"]
    num_layers, num_experts = pi_NSLE.shape[2:]
    assert len(sigma_LE) == num_layers
    assert all(sorted(row) == list(range(num_experts)) for row in sigma_LE), "not a permutation per layer"
    if MODES[method] != "global":
        labels_LE = record["base_communities"]["labels"]
        for labels_E, sigma_E in zip(labels_LE, sigma_LE, strict=True):
            assert all(labels_E[sigma_E[e]] == labels_E[e] for e in range(num_experts)), "left its community"
    shuffled_NSLE = shuffle_by_hand(pi_NSLE, sigma_LE)
    assert seen["forwards"] and len(seen["batches"]) >= len(seen["forwards"])
    for batch, routers in zip(seen["batches"], seen["forwards"], strict=False):
        assert len(routers) == num_layers
        sample_T, span_T = batch["rpb_sample_index"].reshape(-1), batch["rpb_span"].reshape(-1)
        valid_T = batch["attention_mask"].reshape(-1).bool()
        assert (valid_T & (span_T >= 0)).any(), "no content token: nothing carries the prior"
        for layer, (z_TE, chosen) in enumerate(routers):
            expected = hand_choice(method, shuffled_NSLE, layer, z_TE, sample_T, span_T, valid_T)
            wrong = sum(a != b for a, b in zip(chosen, expected, strict=True))
            assert wrong == 0, f"{method} layer {layer}: {wrong} of {len(chosen)} tokens chose otherwise"


def is_involution(sigma_E: list[int]) -> bool:
    return all(sigma_E[sigma_E[e]] == e for e in range(len(sigma_E)))


@pytest.mark.parametrize("method", CONTROLS)
def test_the_control_trains_on_the_prior_shuffled_by_its_recorded_permutation(setup, tmp_path, method, monkeypatch):
    seen, record = train_control(setup, tmp_path, method, monkeypatch)
    assert record["shuffle"]["mode"] == MODES[method] and record["shuffle"]["seed"] == SHUFFLE_SEED
    # in every layer sigma and its inverse must shuffle differently, or the wrong direction could pass there
    assert not any(is_involution(row) for row in record["shuffle"]["sigma"]), f"seed {SHUFFLE_SEED}: an involution"
    check_control(method, seen, record, setup[3])


def inverse_shuffle(monkeypatch):
    """The bug: pi'[..., sigma^-1(e)] = pi[..., e], the permutation applied the wrong way round."""
    shuffle = rpb.anchors.prior_routing.shuffle_prior
    monkeypatch.setattr(
        rpb.anchors.prior_routing, "shuffle_prior", lambda pi, sigma_LE: shuffle(pi, sigma_LE.argsort(dim=1))
    )


def unshuffled(monkeypatch):
    """The bug: the control trains on the prior as collected, ignoring its permutation."""
    monkeypatch.setattr(rpb.anchors.prior_routing, "shuffle_prior", lambda pi, sigma_LE: pi)


@pytest.mark.parametrize("method", CONTROLS)
@pytest.mark.parametrize("mutant", [unshuffled, inverse_shuffle], ids=["ignored", "inverse"])
def test_mutant_ignored_or_inverse_permutation_is_caught(setup, tmp_path, method, mutant, monkeypatch):
    mutant(monkeypatch)
    seen, record = train_control(setup, tmp_path, method, monkeypatch)
    with pytest.raises(AssertionError, match="chose otherwise"):
        check_control(method, seen, record, setup[3])
