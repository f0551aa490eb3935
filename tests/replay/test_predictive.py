"""PR2's recording forward and its predictor's loss against hand computations, on DeepSeek-V3 (sigmoid scores,
expert-correction bias, group-limited top-k) and Qwen3-MoE (softmax):

* the recorded experts are the family's own selection on router + predictor logits: the model's own router with
  the predictor's weight added to its own (``(W_r + W_p) x = W_r x + W_p x``) chooses them;
* the gates the experts receive are the family's, from the unbiased logits (written out per family);
* the predictor's gradient is the hand KL's, in the family's transform, over the counted tokens only;
* the router's gradient in a forward that replays PR2's routes and trains the predictor is R2's on those routes.
"""

from __future__ import annotations

import copy

import pytest
import torch

from rpb.adapters import find_moe_layers, get_adapter
from rpb.replay import RoutePredictor, RouteReplay, predictor_loss
from rpb.testing.models import build_tiny_model

pytestmark = pytest.mark.usefixtures("one_thread")

FAMILIES = {"deepseek_v3_grouped": "sigmoid-normalized", "qwen3_moe": "softmax"}
VOCAB, B, S, C = 64, 3, 7, 4


def hand_gates(router, logits_TE: torch.Tensor, ids_TK: torch.Tensor) -> torch.Tensor:
    """The family's gates at ``ids_TK`` from the unbiased logits, written out from the transformers routers."""
    if hasattr(router, "e_score_correction_bias"):  # DeepSeek-V3: sigmoid, renormalised, scaled
        w = logits_TE.sigmoid().gather(1, ids_TK)
        w = w / (w.sum(-1, keepdim=True) + 1e-20)
        return w * router.routed_scaling_factor
    w = torch.softmax(logits_TE, dim=-1, dtype=torch.float).gather(1, ids_TK)  # Qwen3-MoE: softmax, renormalised
    return w / w.sum(-1, keepdim=True)


def hand_probs(logits_TE: torch.Tensor, transform: str) -> torch.Tensor:
    if transform == "softmax":
        return torch.softmax(logits_TE, dim=-1)
    s = logits_TE.sigmoid()
    return s / s.sum(-1, keepdim=True)


class Seen:
    """Each router's input and raw output (read before any replacement), and what the experts received after."""

    def __init__(self, layers):
        self.raw, self.used, self.handles = {}, {}, []
        for pos, m in enumerate(layers):
            self.handles.append(m.router.register_forward_hook(self._raw(pos), prepend=True))
            self.handles.append(m.router.register_forward_hook(self._used(pos)))

    def _raw(self, pos):
        return lambda mod, args, out: self.raw.__setitem__(pos, (args[0].reshape(-1, args[0].shape[-1]), *out))

    def _used(self, pos):
        return lambda mod, args, out: self.used.__setitem__(pos, out)

    def remove(self):
        for h in self.handles:
            h.remove()


def setup(arch: str):
    model = build_tiny_model(arch, VOCAB, seed=3)
    layers = find_moe_layers(model, get_adapter(model.config.model_type))
    replay = RouteReplay(model)
    widths = [m.router.weight.shape[1] for m in layers]
    predictor = RoutePredictor(widths, [m.router.weight.shape[0] for m in layers])
    gen = torch.Generator().manual_seed(11)
    with torch.no_grad():
        for linear in predictor.linears:
            linear.weight.copy_(torch.randn(linear.weight.shape, generator=gen) * 3.0 / linear.weight.shape[1] ** 0.5)
    ids = torch.randint(0, VOCAB, (B, S), generator=gen)
    return model, layers, replay, predictor, ids


@pytest.mark.parametrize("arch", FAMILIES)
def test_the_recorded_experts_are_the_familys_selection_on_router_plus_predictor_gates_unbiased(arch):
    model, layers, replay, predictor, ids = setup(arch)
    seen = Seen(layers)
    with torch.no_grad(), replay.forward(predictor=predictor, keep_last=C):
        model(input_ids=ids)
    chosen = replay.chosen_BSLK
    moved = 0
    for pos, m in enumerate(layers):
        hidden_TH, logits_TE, _, native_TK = seen.raw[pos]
        shifted = copy.deepcopy(m.router)
        shifted._forward_hooks.clear()  # the copy's forward is the family's own, no hook of this test or of rpb's
        with torch.no_grad():
            shifted.weight += predictor.linears[pos].weight
            want_TK = shifted(hidden_TH)[2]
        got_TK = chosen[:, :, pos].reshape(B * S, -1).long()
        assert torch.equal(got_TK.sort(-1).values, want_TK.sort(-1).values), pos
        moved += int((got_TK.sort(-1).values != native_TK.sort(-1).values).any(-1).sum())
        _, gates_TK, used_TK = seen.used[pos]
        assert torch.equal(used_TK, got_TK)
        torch.testing.assert_close(gates_TK, hand_gates(m.router, logits_TE, got_TK).to(gates_TK.dtype))
        # what the predictor learns from: the routers' inputs and logits at the completion positions
        torch.testing.assert_close(replay.kept_inputs_BCLH[:, :, pos], hidden_TH.reshape(B, S, -1)[:, -C:])
        torch.testing.assert_close(replay.kept_BCLE[:, :, pos], logits_TE.reshape(B, S, -1)[:, -C:])
    assert moved > 0, "the predictor changed no token's experts: the test would show nothing"
    seen.remove()
    replay.remove()


@pytest.mark.parametrize("arch, transform", FAMILIES.items())
def test_the_predictors_gradient_is_the_hand_kl_and_the_routers_is_r2s(arch, transform):
    model, layers, replay, predictor, ids = setup(arch)
    with torch.no_grad(), replay.forward(predictor=predictor, keep_last=C):
        model(input_ids=ids)
    routes, inputs, recorded = replay.chosen_BSLK, replay.kept_inputs_BCLH, replay.kept_BCLE
    count_BC = torch.ones(B, C, dtype=torch.bool)
    count_BC[0, :2] = False  # padding: counted nowhere
    with torch.no_grad():  # the policy moved since the first forward
        for m in layers:
            m.router.weight.add_(torch.randn_like(m.router.weight) * 0.3)
    model.train()

    def step(with_predictor: bool):
        model.zero_grad(set_to_none=True)
        predictor.zero_grad(set_to_none=True)
        with replay.forward(routes, keep_last=C):
            out = model(input_ids=ids).logits.pow(2).mean()
            live = replay.kept_BCLE
            if with_predictor:
                out = out + predictor_loss(predictor, inputs, recorded, live, count_BC, transform)
        out.backward()
        return [m.router.weight.grad.clone() for m in layers], live.detach()

    r2_grads, _ = step(False)
    pr2_grads, live = step(True)
    for pos in range(len(layers)):
        torch.testing.assert_close(pr2_grads[pos], r2_grads[pos], rtol=0, atol=0)  # the predictor never reaches it
        W = predictor.linears[pos].weight.detach().clone().requires_grad_(True)
        x_TH = inputs[:, :, pos].reshape(-1, inputs.shape[-1])
        q_TE = hand_probs(recorded[:, :, pos].reshape(x_TH.shape[0], -1) + x_TH @ W.T, transform)
        p_TE = hand_probs(live[:, :, pos].reshape(x_TH.shape[0], -1), transform)
        kl_T = (p_TE * (p_TE.log() - q_TE.log())).sum(-1)
        kl_T[count_BC.reshape(-1)].mean().backward()
        assert W.grad.abs().max() > 1e-6, "a vanishing hand gradient would tell nothing"
        torch.testing.assert_close(predictor.linears[pos].weight.grad, W.grad, rtol=1e-4, atol=1e-7)
    replay.remove()


def test_a_new_predictor_is_zero_and_draws_nothing_from_the_global_rng():
    torch.manual_seed(5)
    before = torch.rand(3)
    torch.manual_seed(5)
    predictor = RoutePredictor([8, 8], [4, 4])
    assert torch.equal(torch.rand(3), before)
    assert all(not linear.weight.any() for linear in predictor.linears)
