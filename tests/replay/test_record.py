"""GenerationRecorder against the model's own full forward: three left-padded prompts of different lengths, five
tokens generated (greedy, sampled, sampled under a top-k warper; with a KV cache, without one, and with the
prompt prefilled in chunks of two), then one forward over the generated sequences with their attention mask.
Its routers' top-k is read where the experts receive it (a pre-hook on each
``mlp.experts``), its log-probabilities from its logits; neither goes through the recorder."""

from __future__ import annotations

import re

import pytest
import torch

from rpb.adapters import find_moe_layers, get_adapter
from rpb.errors import ArgumentError
from rpb.replay import GenerationRecorder
from rpb.testing.models import build_tiny_model

pytestmark = pytest.mark.usefixtures("one_thread")

VOCAB = 64
NEW = 5
LENGTHS = (3, 6, 4)
ARCHS = ["qwen3_moe", "moonlight", "gpt_oss"]
#: name -> (recorder temperature, generate's sampling kwargs)
MODES = {
    "greedy": (1.0, {"do_sample": False}),
    "sampled": (0.7, {"do_sample": True, "temperature": 0.7, "top_k": 0, "top_p": 1.0}),
    "sampled-top5": (0.7, {"do_sample": True, "temperature": 0.7, "top_k": 5, "top_p": 1.0}),
}
#: generation paths -> generate's keywords: each forward's positions are placed by its offset, never by counting
PATHS = {"cache": {}, "no-cache": {"use_cache": False}, "chunked-prefill": {"prefill_chunk_size": 2}}


def layers_of(model):
    return find_moe_layers(model, get_adapter(model.config.model_type))


def prompts() -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(1)
    P = max(LENGTHS)
    ids_BP = torch.zeros((len(LENGTHS), P), dtype=torch.long)
    mask_BP = torch.zeros((len(LENGTHS), P), dtype=torch.long)
    for b, n in enumerate(LENGTHS):
        ids_BP[b, P - n :] = torch.randint(1, VOCAB, (n,), generator=gen)
        mask_BP[b, P - n :] = 1
    return ids_BP, mask_BP


@pytest.fixture(scope="module")
def generated():
    """generated(arch, mode, path) -> (model, prompt_mask_BP, sequences_BN, routes_BSLK, logps_BC, full forward's
    (logits_BNV, experts' top-k per layer [B, N, K]))."""
    cache = {}

    def make(arch, mode, path="cache"):
        if (arch, mode, path) not in cache:
            model = build_tiny_model(arch, VOCAB, seed=0)
            layers = layers_of(model)
            temperature, sampling = MODES[mode]
            ids_BP, mask_BP = prompts()
            torch.manual_seed(5)
            with GenerationRecorder(model, layers, temperature) as rec:
                seqs_BN = model.generate(
                    input_ids=ids_BP,
                    attention_mask=mask_BP,
                    max_new_tokens=NEW,
                    min_new_tokens=NEW,
                    pad_token_id=0,
                    **sampling,
                    **PATHS[path],
                )
            assert rec.problem is None
            cache[arch, mode, path] = (
                model,
                mask_BP,
                seqs_BN,
                rec.routes_BSLK,
                rec.logps(seqs_BN, prompt_len=mask_BP.shape[1]),
                full_forward(model, mask_BP, seqs_BN),
            )
        return cache[arch, mode, path]

    return make


def full_forward(model, mask_BP, seqs_BN):
    """One forward over the generated sequences: its logits and, per MoE layer, the top-k its experts receive."""
    seen = {}
    experts = [model.get_submodule(m.name.rpartition(".")[0] + ".experts") for m in layers_of(model)]
    handles = [
        e.register_forward_pre_hook(lambda module, args, pos=pos: seen.update({pos: args[1].detach().clone()}))
        for pos, e in enumerate(experts)
    ]
    B, N = seqs_BN.shape
    mask_BN = torch.cat([mask_BP, torch.ones((B, N - mask_BP.shape[1]), dtype=torch.long)], dim=1)
    try:
        with torch.no_grad():
            logits_BNV = model(input_ids=seqs_BN, attention_mask=mask_BN).logits
    finally:
        for h in handles:
            h.remove()
    return logits_BNV, [seen[pos].reshape(B, N, -1) for pos in range(len(experts))]


@pytest.mark.parametrize("path", PATHS)
@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("arch", ARCHS)
def test_routes_are_the_full_forwards_at_every_real_position(arch, mode, path, generated):
    model, mask_BP, seqs_BN, routes_BSLK, _, (_, experts_ids) = generated(arch, mode, path)
    B, N = seqs_BN.shape
    P = mask_BP.shape[1]
    assert N == P + NEW
    # the last generated token is never forwarded
    assert routes_BSLK.shape == (B, P + NEW - 1, len(experts_ids), model.config.num_experts_per_tok)
    compared = 0
    for pos, ids_BNK in enumerate(experts_ids):
        for b in range(B):
            for s in range(P - LENGTHS[b], N - 1):  # the real tokens (pad positions route whatever they hold)
                assert set(routes_BSLK[b, s, pos].tolist()) == set(ids_BNK[b, s].tolist()), (pos, b, s)
                compared += 1
    assert compared == len(experts_ids) * sum(n + NEW - 1 for n in LENGTHS)
    # neighbouring positions route apart, so a recording shifted by a position (the left padding) cannot pass
    real_BS = torch.cat([mask_BP, torch.ones((B, NEW - 1), dtype=torch.long)], dim=1).bool()
    sorted_BSLK = routes_BSLK.sort(-1).values
    moved_BS = (sorted_BSLK[:, 1:] != sorted_BSLK[:, :-1]).any(-1).any(-1)
    assert moved_BS[real_BS[:, 1:] & real_BS[:, :-1]].any()


@pytest.mark.parametrize("path", PATHS)
@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("arch", ARCHS)
def test_logps_are_the_raw_logits_over_the_temperature(arch, mode, path, generated):
    _, mask_BP, seqs_BN, _, logps_BC, (logits_BNV, _) = generated(arch, mode, path)
    temperature, sampling = MODES[mode]
    P = mask_BP.shape[1]
    # token t's log-probability is read at position t - 1
    logits_BCV = logits_BNV[:, P - 1 : -1].double() / temperature
    tokens_BC1 = seqs_BN[:, P:, None]
    want_BC = torch.log_softmax(logits_BCV, dim=-1).gather(2, tokens_BC1).squeeze(2)
    assert logps_BC.shape == (len(LENGTHS), NEW)
    torch.testing.assert_close(logps_BC.double(), want_BC, atol=1e-5, rtol=0)
    if not sampling["do_sample"]:  # the full forward agrees with what greedy chose
        assert torch.equal(logits_BCV.argmax(-1), seqs_BN[:, P:])
    if sampling.get("top_k"):
        # the warped distribution (renormalised over the top 5) is another figure: the check above tells them apart
        top_BCV = logits_BCV.masked_fill(logits_BCV < logits_BCV.topk(5, dim=-1).values[..., -1:], float("-inf"))
        warped_BC = torch.log_softmax(top_BCV, dim=-1).gather(2, tokens_BC1).squeeze(2)
        assert torch.isfinite(warped_BC).all()  # every drawn token was among the top 5
        assert ((warped_BC - want_BC) > 1e-3).all()


def test_nothing_recorded_is_refused():
    model = build_tiny_model("qwen3_moe", VOCAB, seed=0)
    with GenerationRecorder(model, layers_of(model)) as rec:
        pass
    with pytest.raises(ArgumentError, match="nothing was recorded"):
        _ = rec.routes_BSLK
    with pytest.raises(ArgumentError, match="nothing was recorded"):
        rec.logps(torch.zeros((1, 3), dtype=torch.long))


@pytest.mark.parametrize("temperature", [0.0, -0.5])
def test_a_temperature_that_is_not_positive_is_refused(temperature):
    model = build_tiny_model("qwen3_moe", VOCAB, seed=0)
    with pytest.raises(ArgumentError, match=re.escape(f"temperature={temperature}")):
        GenerationRecorder(model, layers_of(model), temperature)


def hook_counts(model, layers) -> list[int]:
    routers = [m.router for m in layers]
    return [len(r._forward_hooks) for r in routers] + [len(model._forward_hooks), len(model._forward_pre_hooks)]


def test_the_hooks_are_gone_after_the_block():
    model = build_tiny_model("qwen3_moe", VOCAB, seed=0)
    layers = layers_of(model)
    before = hook_counts(model, layers)
    assert before == [0] * len(before)
    ids_BP, mask_BP = prompts()
    with GenerationRecorder(model, layers) as rec:
        assert all(n > 0 for n in hook_counts(model, layers))  # the check below has something to see removed
        model.generate(input_ids=ids_BP, attention_mask=mask_BP, max_new_tokens=2, do_sample=False, pad_token_id=0)
    assert hook_counts(model, layers) == before
    routes_BSLK = rec.routes_BSLK
    with pytest.raises(RuntimeError, match="inside"), GenerationRecorder(model, layers):
        raise RuntimeError("inside")
    assert hook_counts(model, layers) == before
    # a forward after the block records nothing
    model(input_ids=ids_BP, attention_mask=mask_BP)
    assert torch.equal(rec.routes_BSLK, routes_BSLK)


def test_a_forward_that_starts_past_the_recording_is_not_placed():
    """A cache filled outside the recorder: the forward's positions are not the first ones, so its routes would
    land on the prompt's; the recorder says so and refuses to hand them out."""
    model = build_tiny_model("qwen3_moe", VOCAB, seed=0)
    ids_BP, mask_BP = prompts()
    with torch.no_grad():
        cache = model(input_ids=ids_BP, attention_mask=mask_BP, use_cache=True).past_key_values
        step_B1 = torch.ones((ids_BP.shape[0], 1), dtype=torch.long)
        with GenerationRecorder(model, layers_of(model)) as rec:
            model(input_ids=step_B1, attention_mask=torch.cat([mask_BP, step_B1], 1), cache=cache)
    assert rec.problem is not None and "positions 0..5 were forwarded outside the recorder" in rec.problem
    with pytest.raises(ArgumentError, match="cannot be placed: a forward starting at position 6"):
        _ = rec.routes_BSLK


def test_positions_forwarded_again_with_other_tokens_are_not_placed():
    """Speculative decoding forwards draft tokens, then forwards their positions again with others: which of two
    forwards' routes belongs to the token kept is unknowable from the positions, so none is handed out."""
    model = build_tiny_model("qwen3_moe", VOCAB, seed=0)
    ids_BP, mask_BP = prompts()
    with torch.no_grad(), GenerationRecorder(model, layers_of(model)) as rec:
        model(input_ids=ids_BP, attention_mask=mask_BP, use_cache=False)
        model(input_ids=ids_BP, attention_mask=mask_BP, use_cache=False)  # the same tokens again: kept, placed
        assert rec.problem is None
        other = ids_BP.clone()
        other[:, -1] = (other[:, -1] + 1) % VOCAB
        model(input_ids=other, attention_mask=mask_BP, use_cache=False)
    assert rec.problem is not None and "forwarded again with other tokens" in rec.problem
    with pytest.raises(ArgumentError, match="cannot be placed"):
        _ = rec.routes_BSLK


def test_routes_alone_take_no_log_softmax():
    """``logps=False`` (``rpb routes``: a model without a language-model head) reads no output at all."""
    model = build_tiny_model("qwen3_moe", VOCAB, seed=0)
    ids_BP, mask_BP = prompts()
    with torch.no_grad(), GenerationRecorder(model.model, layers_of(model), logps=False) as rec:
        model.model(input_ids=ids_BP, attention_mask=mask_BP, use_cache=False)
    assert rec.routes_BSLK.shape[:2] == ids_BP.shape
    with pytest.raises(ArgumentError, match="nothing was recorded"):
        rec.logps(ids_BP)


def test_recording_stays_on_the_device_until_it_is_read(monkeypatch):
    """No copy to the host at any router call or step of generation: the routes and log-probabilities leave the
    device once each, when read (a CPU run cannot see a device, so the test counts the copies asked for)."""
    model = build_tiny_model("qwen3_moe", VOCAB, seed=0)
    ids_BP, mask_BP = prompts()
    copies = []
    cpu = torch.Tensor.cpu
    monkeypatch.setattr(torch.Tensor, "cpu", lambda self, *a, **k: copies.append(tuple(self.shape)) or cpu(self))
    with GenerationRecorder(model, layers_of(model)) as rec:
        seqs = model.generate(input_ids=ids_BP, attention_mask=mask_BP, max_new_tokens=NEW, min_new_tokens=NEW,
                              do_sample=False, pad_token_id=0)  # fmt: skip
    during = list(copies)
    routes, logps = rec.routes_BSLK, rec.logps(seqs, prompt_len=ids_BP.shape[1])
    assert during == [] and len(copies) == 2  # one transfer each, when read
    assert routes.shape[1] == ids_BP.shape[1] + NEW - 1 and logps.shape == (len(LENGTHS), NEW)
