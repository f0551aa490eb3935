"""``install_anchor`` on tiny models of every family: what the routers hand to the MoE blocks.

The checks look at the routers from outside: forward hooks registered after the anchor's
see the output the MoE block receives, and the native output is recomputed by calling the
router's own ``forward`` on the captured hidden states. Selections and gates are compared
with the per-family references of ``tests.test_routing`` (written from the transformers
sources), with the prior bias of eq. 3 computed by hand here; the loss terms are compared
with transformers' ``load_balancing_loss_func`` and with hand computations on captured
logits and hidden states.
"""

from __future__ import annotations

import copy

import pytest
import torch
from transformers.models.qwen3_moe.modeling_qwen3_moe import load_balancing_loss_func

from rpb.anchors import AnchorConfig, install_anchor
from rpb.testing.models import ARCHITECTURES, build_tiny_model
from tests.test_routing import canonical, reference_gates, reference_route

VOCAB = 64
NUM_PRIOR_ROWS = 4
# three rows of eight tokens; 0 = Q, 1 = A, -1 = structural; row 2 ends in three padding tokens
SPAN_BT = torch.tensor(
    [
        [-1, -1, 0, 0, 0, -1, 1, 1],
        [-1, 0, 0, -1, 1, 1, 1, -1],
        [-1, 0, -1, 1, 1, -1, -1, -1],
    ]
)
ROW_SAMPLE = torch.tensor([2, 0, 3])  # rows of the prior; prior row 1 is not in the batch
MASK_BT = torch.tensor([[1] * 8, [1] * 8, [1] * 5 + [0] * 3])
SAMPLE_BT = torch.where(MASK_BT.bool(), ROW_SAMPLE[:, None].expand(-1, 8), torch.tensor(-1))
VALID_T = MASK_BT.reshape(-1).bool()
CONTENT_T = (SPAN_BT.reshape(-1) >= 0) & VALID_T
FOCUS = ["moonlight", "qwen3_moe", "mixtral"]


pytestmark = pytest.mark.usefixtures("one_thread")


def router_modules(model) -> list[torch.nn.Module]:
    """The routers in layer order, found by class name (independently of ``rpb.adapters``)."""
    return [m for m in model.modules() if type(m).__name__.endswith(("TopkRouter", "TopKRouter"))]


def make_case(arch: str, seed: int = 0):
    model = build_tiny_model(arch, vocab_size=VOCAB, seed=seed)
    routers = router_modules(model)
    gen = torch.Generator().manual_seed(seed + 100)
    pi = torch.softmax(
        2.0 * torch.randn(NUM_PRIOR_ROWS, 2, len(routers), routers[0].weight.shape[0], generator=gen), -1
    )
    input_ids = torch.randint(1, VOCAB, SPAN_BT.shape, generator=gen).masked_fill(~MASK_BT.bool(), 0)
    return model, routers, pi, input_ids


def forward(model, input_ids, labels: bool = False):
    kwargs = {"labels": input_ids.masked_fill(~MASK_BT.bool(), -100)} if labels else {}
    return model(input_ids=input_ids, attention_mask=MASK_BT, **kwargs)


def step(handle, mask_BT=MASK_BT, span_BT=SPAN_BT):
    return handle.step(SAMPLE_BT, span_BT, mask_BT)


def hand_bias(pi_E: torch.Tensor, eps: float = 0.05, clip: float = 5.0) -> torch.Tensor:
    """Eq. 3 by hand: q = clamp(pi, eps/E, C/E) renormalised; b = log q - mean_e log q."""
    E = pi_E.shape[-1]
    q = pi_E.double().clamp(eps / E, clip / E)
    log_q = (q / q.sum(-1, keepdim=True)).log()
    return log_q - log_q.mean(-1, keepdim=True)


def prior_rows_T(pi: torch.Tensor, layer: int) -> torch.Tensor:
    """pi[x_t, s_t, layer] for every token (rows of non-content tokens are arbitrary)."""
    return pi[SAMPLE_BT.reshape(-1).clamp_min(0), SPAN_BT.reshape(-1).clamp_min(0), layer]


class RouterTap:
    """Forward hooks registered after the anchor's: each call's (hidden_TH, logits, gates, ids)."""

    def __init__(self, routers):
        self.calls = [[] for _ in routers]
        self.handles = [r.register_forward_hook(self._hook(i)) for i, r in enumerate(routers)]

    def _hook(self, i):
        def hook(module, args, output):
            hidden = args[0].detach()
            self.calls[i].append((hidden.reshape(-1, hidden.shape[-1]).clone(), *(o.detach().clone() for o in output)))

        return hook

    def remove(self):
        for h in self.handles:
            h.remove()


def native(router, hidden_TH):
    """The router's own output on ``hidden_TH``, bypassing every hook."""
    with torch.no_grad():
        return router.forward(hidden_TH)


def hook_count(model) -> int:
    return sum(len(m._forward_hooks) + len(m._forward_pre_hooks) for m in model.modules())


def hook_ids(model) -> dict[str, tuple]:
    """Every module's forward and forward-pre hook ids, by module name."""
    return {n: (*m._forward_hooks, *m._forward_pre_hooks) for n, m in model.named_modules()}


def named_routers(model):
    return [(n, m) for n, m in model.named_modules() if type(m).__name__.endswith(("TopkRouter", "TopKRouter"))]


# --------------------------------------------------------------------------- prior routing


def check_prior_routing(routers, tap, pi, selection: str, beta: float = 1.0) -> int:
    """Per layer: structural and padding tokens native, content tokens as the reference; returns
    the number of (layer, token) pairs whose selection differs from the native one."""
    changed = 0
    for layer, router in enumerate(routers):
        hidden_TH, logits_TE, gates_TK, ids_TK = tap.calls[layer][-1]
        native_logits, native_gates, native_ids = native(router, hidden_TH)
        assert torch.equal(logits_TE, native_logits)
        assert torch.equal(ids_TK[~CONTENT_T], native_ids[~CONTENT_T])
        assert torch.equal(gates_TK[~CONTENT_T], native_gates[~CONTENT_T])

        z_CE = logits_TE[CONTENT_T]
        rows_CE = prior_rows_T(pi, layer)[CONTENT_T]
        if selection == "soft":
            ref_ids, ref_gates = reference_route(router, z_CE, (beta * hand_bias(rows_CE)).float())
        else:
            ref_ids = torch.topk(rows_CE.double(), router.top_k, dim=-1).indices.sort(-1).values
            ref_gates = reference_gates(router, z_CE, ref_ids)
        got_gates, got_ids = canonical(gates_TK[CONTENT_T], ids_TK[CONTENT_T])
        assert torch.equal(got_ids, ref_ids)
        assert gates_TK.dtype == native_gates.dtype
        torch.testing.assert_close(got_gates.double(), ref_gates, rtol=1e-5, atol=1e-6)
        changed += int((got_ids != native_ids[CONTENT_T].sort(-1).values).any(-1).sum())
    return changed


@pytest.mark.parametrize("arch", sorted(ARCHITECTURES))
def test_rpb_selects_on_biased_logits_and_keeps_structural_and_padding_native(arch):
    model, routers, pi, input_ids = make_case(arch)
    model.train()
    handle = install_anchor(model, AnchorConfig(method="rpb", beta=1.0), prior=pi, record_stats=True)
    tap = RouterTap(routers)
    with step(handle), torch.no_grad():
        forward(model, input_ids)
        assert float(handle.loss()) == 0.0
    assert check_prior_routing(routers, tap, pi, "soft") > 0

    stats = handle.reset_stats()
    assert sorted(stats) == list(range(len(routers)))
    for layer, router in enumerate(routers):
        hidden_TH, _, _, ids_TK = tap.calls[layer][-1]
        native_ids = native(router, hidden_TH)[2]
        ids, nat = ids_TK[VALID_T].sort(-1).values, native_ids[VALID_T].sort(-1).values
        assert stats[layer].tokens == int(VALID_T.sum()) and stats[layer].content == int(CONTENT_T.sum())
        # structural tokens keep the native choice, so every changed token is a content token; the
        # fraction is over content tokens (the only ones the bias can reach)
        content_ids, content_nat = ids_TK[CONTENT_T].sort(-1).values, native_ids[CONTENT_T].sort(-1).values
        assert (
            stats[layer].changed == int((content_ids != content_nat).any(-1).sum()) == int((ids != nat).any(-1).sum())
        )
        assert stats[layer].changed_fraction == stats[layer].changed / int(CONTENT_T.sum())
        load = torch.zeros(router.weight.shape[0])
        for e in ids.reshape(-1).tolist():
            load[e] += 1
        assert torch.equal(stats[layer].load_E, load)
    assert handle.reset_stats() == {}


@pytest.mark.parametrize("arch", sorted(ARCHITECTURES))
def test_rpb_hard_forces_the_prior_top_k(arch):
    model, routers, pi, input_ids = make_case(arch, seed=1)
    model.train()
    handle = install_anchor(model, AnchorConfig(method="rpb-hard"), prior=pi)
    tap = RouterTap(routers)
    with step(handle), torch.no_grad():
        forward(model, input_ids)
    assert check_prior_routing(routers, tap, pi, "hard") > 0


def reference_routing_hooks(model, pi, beta: float = 1.0):
    """Hooks that make an un-anchored model route as the reference says (train mode only)."""

    def make(layer):
        def hook(module, args, output):
            logits_TE, gates_TK, ids_TK = output
            z_CE = logits_TE.detach()[CONTENT_T]
            ref_ids, ref_gates = reference_route(
                module, z_CE, (beta * hand_bias(prior_rows_T(pi, layer)[CONTENT_T])).float()
            )
            ids_TK, gates_TK = ids_TK.clone(), gates_TK.detach().clone()
            ids_TK[CONTENT_T] = ref_ids
            gates_TK[CONTENT_T] = ref_gates.to(gates_TK.dtype)
            return logits_TE, gates_TK, ids_TK

        return hook

    return [r.register_forward_hook(make(i)) for i, r in enumerate(router_modules(model))]


@pytest.mark.parametrize("arch", FOCUS)
def test_rpb_model_output_equals_the_model_routed_by_the_reference(arch):
    model, _, pi, input_ids = make_case(arch, seed=2)
    model.train()
    reference_model = copy.deepcopy(model)
    with torch.no_grad():
        native_logits = forward(model, input_ids).logits
    hooks = reference_routing_hooks(reference_model, pi)
    handle = install_anchor(model, AnchorConfig(method="rpb", beta=1.0), prior=pi)
    with torch.no_grad():
        with step(handle):
            got = forward(model, input_ids).logits
        expected = forward(reference_model, input_ids).logits
    for h in hooks:
        h.remove()
    valid = MASK_BT.bool()
    torch.testing.assert_close(got[valid], expected[valid], rtol=1e-5, atol=1e-5)
    assert (got[valid] - native_logits[valid]).abs().max() > 1e-3  # the anchor did change the model


# --------------------------------------------------------------------------- native paths


@pytest.mark.parametrize("arch", sorted(ARCHITECTURES))
def test_eval_mode_and_train_mode_without_context_are_native(arch):
    model, _, pi, input_ids = make_case(arch)
    with torch.no_grad():
        base_eval = forward(model.eval(), input_ids).logits
        base_train = forward(model.train(), input_ids).logits
    handle = install_anchor(model, AnchorConfig(method="rpb", beta=1.0), prior=pi)
    with torch.no_grad():
        model.eval()
        assert torch.equal(forward(model, input_ids).logits, base_eval)
        with step(handle):
            assert torch.equal(forward(model, input_ids).logits, base_eval)
            assert float(handle.loss()) == 0.0
        model.train()
        assert torch.equal(forward(model, input_ids).logits, base_train)
        with step(handle):
            assert not torch.equal(forward(model, input_ids).logits, base_train)


@pytest.mark.parametrize("arch", sorted(ARCHITECTURES))
def test_remove_restores_the_model(arch):
    model, routers, pi, input_ids = make_case(arch)
    handle = install_anchor(model, AnchorConfig(method="rpb", beta=1.0), prior=pi)
    assert all(len(r._forward_hooks) == 1 for r in routers)
    handle.remove()
    assert all(len(r._forward_hooks) == 0 for r in routers)
    assert hook_count(model) == 0

    model.config.output_router_logits = True
    with torch.no_grad():
        base_train = forward(model.train(), input_ids).logits
    # transformers keeps output-capturing hooks of its own from the first forward on
    hooks_before = hook_ids(model)
    handle = install_anchor(model, AnchorConfig(method="rpb", beta=1.0), prior=pi)
    assert all(len(r._forward_hooks) == len(hooks_before[name]) + 1 for name, r in named_routers(model))
    assert model.config.output_router_logits is False
    with step(handle), torch.no_grad():
        anchored = forward(model, input_ids).logits
    assert not torch.equal(anchored, base_train)

    handle.remove()
    assert hook_ids(model) == hooks_before
    assert model.config.output_router_logits is True
    model.config.output_router_logits = False
    with step(handle), torch.no_grad():
        assert torch.equal(forward(model, input_ids).logits, base_train)
    handle.remove()  # a second removal is harmless
    assert hook_ids(model) == hooks_before


@pytest.mark.parametrize("arch", sorted(ARCHITECTURES))
def test_beta_zero_reproduces_native_training_bit_exactly(arch):
    model, routers, pi, input_ids = make_case(arch)
    model.train()
    with torch.no_grad():
        base = forward(model, input_ids).logits
    handle = install_anchor(model, AnchorConfig(method="rpb", beta=0.0), prior=pi)
    tap = RouterTap(routers)
    with step(handle), torch.no_grad():
        got = forward(model, input_ids).logits
    assert torch.equal(got, base)
    for layer, router in enumerate(routers):
        hidden_TH, _, gates_TK, ids_TK = tap.calls[layer][-1]
        _, native_gates, native_ids = native(router, hidden_TH)
        assert torch.equal(ids_TK, native_ids) and torch.equal(gates_TK, native_gates)


@pytest.mark.parametrize("method", ["sft", "lbl", "router-l2", "kl-to-base", "logit-l2", "router-freeze"])
@pytest.mark.parametrize("arch", ["moonlight", "qwen3_moe"])
def test_methods_without_a_prior_leave_the_forward_native(arch, method):
    model, _, _, input_ids = make_case(arch)
    model.train()
    with torch.no_grad():
        base = forward(model, input_ids).logits
    handle = install_anchor(model, AnchorConfig.for_method(method, lambda_=0.1, lbl_coef=0.01))
    with step(handle), torch.no_grad():
        assert torch.equal(forward(model, input_ids).logits, base)


# --------------------------------------------------------------------------- gradient checkpointing


def loss_and_grads(model, handle, input_ids, routers):
    calls = [0]
    counters = [r.register_forward_hook(lambda *_: calls.__setitem__(0, calls[0] + 1)) for r in routers]
    model.zero_grad(set_to_none=True)
    with step(handle):
        out = forward(model, input_ids, labels=True)
        loss = out.loss + handle.loss()
        loss.backward()
    for h in counters:
        h.remove()
    grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    return loss.detach(), grads, calls[0]


CHECKPOINT_CASES = [
    *[(arch, method) for arch in FOCUS for method in ("rpb", "rpb-hard")],
    *[(arch, "kl-to-base") for arch in FOCUS],
    *[("qwen3_moe", method) for method in ("lbl", "router-l2", "logit-l2")],
]


def test_reentrant_checkpointing_is_refused_for_loss_anchors():
    model = build_tiny_model("qwen3_moe", 64).train()
    handle = install_anchor(model, AnchorConfig(method="router-l2", lambda_=0.1))
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": True})
    ids = torch.randint(1, 64, (2, 6))
    zeros = torch.zeros(2, 6, dtype=torch.long)
    with handle.step(zeros, zeros):
        model(input_ids=ids, labels=ids)
        with pytest.raises(RuntimeError, match="use_reentrant"):
            handle.loss()
    handle.remove()


@pytest.mark.parametrize(("arch", "method"), CHECKPOINT_CASES)
def test_gradient_checkpointing_gives_the_same_loss_and_gradients(arch, method):
    model, routers, pi, input_ids = make_case(arch, seed=3)
    model.train()
    config = AnchorConfig.for_method(method, beta=1.0, lambda_=0.1, lbl_coef=0.01)
    handle = install_anchor(model, config, prior=pi)
    anchor_loss = method not in ("rpb", "rpb-hard")
    if anchor_loss:  # move the routers away from the base so the term and its gradient are not 0
        gen = torch.Generator().manual_seed(5)
        with torch.no_grad():
            for r in routers:
                r.weight.add_(0.3 * torch.randn(r.weight.shape, generator=gen))
    loss, grads, calls = loss_and_grads(model, handle, input_ids, routers)
    assert calls == len(routers)
    if anchor_loss:
        assert float(handle_loss_of(model, handle, input_ids)) > 1e-4

    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    loss_ckpt, grads_ckpt, calls_ckpt = loss_and_grads(model, handle, input_ids, routers)
    assert calls_ckpt == 2 * len(routers)  # the routers really ran again during backward

    assert abs(float(loss) - float(loss_ckpt)) <= 1e-6
    assert grads.keys() == grads_ckpt.keys()
    assert any(n.endswith("mlp.gate.weight") for n in grads)
    for name, g in grads.items():
        assert (g - grads_ckpt[name]).abs().max() <= 1e-6, name


def handle_loss_of(model, handle, input_ids, mask_BT=MASK_BT):
    with step(handle, mask_BT), torch.no_grad():
        forward(model, input_ids)
        return handle.loss()


# --------------------------------------------------------------------------- loss methods


@pytest.mark.parametrize("padded", [False, True], ids=["unpadded", "padded"])
def test_lbl_softmax_equals_transformers_load_balancing_loss_per_layer(padded):
    model, routers, _, input_ids = make_case("qwen3_moe")
    model.train()
    mask_BT = MASK_BT if padded else torch.ones_like(MASK_BT)
    handle = install_anchor(model, AnchorConfig(method="lbl", lbl_coef=0.01))
    tap = RouterTap(routers)
    with step(handle, mask_BT), torch.no_grad():
        model(input_ids=input_ids, attention_mask=mask_BT)
        got = handle.loss()
    per_layer = []
    for layer, router in enumerate(routers):
        logits_TE = tap.calls[layer][-1][1]
        per_layer.append(
            load_balancing_loss_func((logits_TE,), router.weight.shape[0], router.top_k, mask_BT if padded else None)
        )
    expected = 0.01 * torch.stack(per_layer).mean()
    torch.testing.assert_close(got, expected, rtol=1e-6, atol=1e-8)
    assert float(got) > 0.01 * router.top_k  # above the perfectly balanced value k


def test_lbl_sigmoid_is_the_megatron_aux_loss_by_hand():
    model, routers, _, input_ids = make_case("moonlight")
    model.train()
    handle = install_anchor(model, AnchorConfig(method="lbl", lbl_coef=0.01))
    tap = RouterTap(routers)
    with step(handle), torch.no_grad():
        forward(model, input_ids)
        got = handle.loss()
    per_layer = []
    for layer, router in enumerate(routers):
        z = tap.calls[layer][-1][1][VALID_T].double()
        s = torch.sigmoid(z)
        p = s / s.sum(-1, keepdim=True)
        n, E, k = z.shape[0], z.shape[1], router.top_k
        counts = torch.zeros(E, dtype=torch.float64)
        for row in p.tolist():
            for e in sorted(range(E), key=lambda e, row=row: -row[e])[:k]:
                counts[e] += 1
        per_layer.append(E * ((counts / (n * k)) * (p.sum(0) / n)).sum())
    torch.testing.assert_close(got.double(), 0.01 * torch.stack(per_layer).mean(), rtol=1e-5, atol=1e-8)


@pytest.mark.parametrize("arch", FOCUS)
def test_router_l2_is_the_squared_distance_to_the_base_weights(arch):
    model, routers, _, input_ids = make_case(arch)
    model.train()
    base = [r.weight.detach().clone() for r in routers]
    handle = install_anchor(model, AnchorConfig(method="router-l2", lambda_=0.1))
    assert float(handle_loss_of(model, handle, input_ids)) == 0.0

    gen = torch.Generator().manual_seed(11)
    with torch.no_grad():
        for r in routers:
            r.weight.add_(0.05 * torch.randn(r.weight.shape, generator=gen))
    model.zero_grad(set_to_none=True)
    with step(handle):
        forward(model, input_ids)
        loss = handle.loss()
        loss.backward()
    L = len(routers)
    by_hand = 0.1 * sum(((r.weight.double() - w0.double()) ** 2).sum() for r, w0 in zip(routers, base, strict=True)) / L
    torch.testing.assert_close(loss.double(), by_hand, rtol=1e-5, atol=1e-8)
    for r, w0 in zip(routers, base, strict=True):
        torch.testing.assert_close(r.weight.grad.double(), 0.1 * 2 * (r.weight.double() - w0.double()) / L)


def hand_kl(z_TE, base_TE, transform):
    def probs(x):
        if transform == "softmax":
            return torch.softmax(x, -1)
        s = torch.sigmoid(x)
        return s / s.sum(-1, keepdim=True)

    p_base, p = probs(base_TE), probs(z_TE)
    return (p_base * (p_base.log() - p.log())).sum(-1).mean()


def hand_logit_l2(z_TE, base_TE, transform):
    diff = (z_TE - z_TE.mean(-1, keepdim=True)) - (base_TE - base_TE.mean(-1, keepdim=True))
    return (diff**2).sum(-1).mean()


@pytest.mark.parametrize(
    ("arch", "method", "given", "transform"),
    [
        ("qwen3_moe", "kl-to-base", "softmax", "softmax"),
        ("mixtral", "kl-to-base", "softmax", "softmax"),
        ("moonlight", "kl-to-base", "sigmoid-normalized", "sigmoid-normalized"),
        # a softmax prior's transform, as rpb train resolves it into the config, on a sigmoid family
        ("moonlight", "kl-to-base", "softmax", "softmax"),
        # neither a prior nor an override: the family's own (a sigmoid router's normalised sigmoid)
        ("moonlight", "kl-to-base", None, "sigmoid-normalized"),
        ("qwen3_moe", "kl-to-base", None, "softmax"),
        ("qwen3_moe", "logit-l2", "softmax", "softmax"),
        ("moonlight", "logit-l2", "softmax", "softmax"),
    ],
)
def test_base_router_losses_by_hand_on_valid_tokens(arch, method, given, transform):
    model, routers, _, input_ids = make_case(arch)
    model.train()
    base = [r.weight.detach().double().clone() for r in routers]
    handle = install_anchor(model, AnchorConfig(method=method, lambda_=0.1, router_transform=given))
    assert float(handle_loss_of(model, handle, input_ids)) == pytest.approx(0.0, abs=1e-9)

    gen = torch.Generator().manual_seed(12)
    with torch.no_grad():
        for r in routers:
            r.weight.add_(0.3 * torch.randn(r.weight.shape, generator=gen))
    tap = RouterTap(routers)
    got = handle_loss_of(model, handle, input_ids)
    term = hand_kl if method == "kl-to-base" else hand_logit_l2
    per_layer = []
    for layer in range(len(routers)):
        hidden_TH, logits_TE = tap.calls[layer][-1][:2]
        # padding tokens left out: the term on the padded batch is the term on its valid tokens
        base_TE = hidden_TH[VALID_T].double() @ base[layer].T
        per_layer.append(term(logits_TE[VALID_T].double(), base_TE, transform))
    expected = 0.1 * torch.stack(per_layer).mean()
    assert float(expected) > 1e-4
    torch.testing.assert_close(got.double(), expected, rtol=1e-5, atol=1e-8)


@pytest.mark.parametrize("method", ["kl-to-base", "logit-l2", "router-l2"])
def test_gpt_oss_base_router_keeps_its_bias(method):
    """gpt-oss's router bias is inside its logits: the frozen base router is weight and bias, both moved here."""
    model, routers, _, input_ids = make_case("gpt_oss")
    model.train()
    base = [(r.weight.detach().double().clone(), r.bias.detach().double().clone()) for r in routers]
    handle = install_anchor(model, AnchorConfig(method=method, lambda_=0.1))
    gen = torch.Generator().manual_seed(12)
    with torch.no_grad():
        for r in routers:
            r.bias.add_(0.5 * torch.randn(r.bias.shape, generator=gen))
            r.weight.add_(0.1 * torch.randn(r.weight.shape, generator=gen))
    tap = RouterTap(routers)
    got = handle_loss_of(model, handle, input_ids)
    per_layer = []
    for layer, r in enumerate(routers):
        w0, b0 = base[layer]
        if method == "router-l2":
            per_layer.append((r.weight.double() - w0).pow(2).sum() + (r.bias.double() - b0).pow(2).sum())
            continue
        hidden_TH, logits_TE = tap.calls[layer][-1][:2]
        base_TE = hidden_TH[VALID_T].double() @ w0.T + b0
        term = hand_kl if method == "kl-to-base" else hand_logit_l2
        per_layer.append(term(logits_TE[VALID_T].double(), base_TE, "softmax"))
    expected = 0.1 * torch.stack(per_layer).mean()
    torch.testing.assert_close(got.double(), expected.detach(), rtol=1e-5, atol=1e-8)
    handle.remove()


@pytest.mark.parametrize("method", ["rpb", "lbl", "kl-to-base", "logit-l2"])
def test_padding_contents_change_nothing(method):
    """Garbage token ids and span labels at padded positions change neither the routing of the valid
    tokens nor the loss term; padded tokens keep the native routing."""
    model, routers, pi, input_ids = make_case("qwen3_moe")
    model.train()
    handle = install_anchor(model, AnchorConfig.for_method(method, lambda_=0.1, lbl_coef=0.01), prior=pi)
    with torch.no_grad():
        for r in routers:
            r.weight.mul_(1.1)  # away from the base, for the base-router losses
    garbage_ids = input_ids.masked_fill(~MASK_BT.bool(), VOCAB - 1)
    garbage_span = SPAN_BT.masked_fill(~MASK_BT.bool(), 1)
    results = []
    for ids, span in ((input_ids, SPAN_BT), (garbage_ids, garbage_span)):
        tap = RouterTap(routers)
        with step(handle, span_BT=span), torch.no_grad():
            forward(model, ids)
            loss = handle.loss()
        tap.remove()
        results.append((loss, [tap.calls[i][-1] for i in range(len(routers))]))
        for layer, router in enumerate(routers):
            hidden_TH, _, gates_TK, ids_TK = tap.calls[layer][-1]
            _, native_gates, native_ids = native(router, hidden_TH)
            assert torch.equal(ids_TK[~VALID_T], native_ids[~VALID_T])
            assert torch.equal(gates_TK[~VALID_T], native_gates[~VALID_T])
    (loss_a, calls_a), (loss_b, calls_b) = results
    torch.testing.assert_close(loss_a, loss_b, rtol=1e-6, atol=1e-8)
    if method != "rpb":
        assert float(loss_a) > 0
    for (_, z_a, g_a, i_a), (_, z_b, g_b, i_b) in zip(calls_a, calls_b, strict=True):
        torch.testing.assert_close(z_a[VALID_T], z_b[VALID_T], rtol=1e-6, atol=1e-6)
        assert torch.equal(i_a[VALID_T], i_b[VALID_T])
        torch.testing.assert_close(g_a[VALID_T], g_b[VALID_T], rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("arch", FOCUS)
def test_router_freeze_freezes_and_removal_restores(arch):
    model, routers, _, input_ids = make_case(arch)
    model.train()
    routers[-1].weight.requires_grad_(False)  # frozen by the user before install: stays frozen
    others = {n: p.requires_grad for n, p in model.named_parameters() if not n.endswith("mlp.gate.weight")}
    handle = install_anchor(model, AnchorConfig(method="router-freeze"))
    assert all(not r.weight.requires_grad for r in routers)
    assert {n: p.requires_grad for n, p in model.named_parameters() if n in others} == others
    model.zero_grad(set_to_none=True)
    with step(handle):
        forward(model, input_ids, labels=True).loss.backward()
    assert all(r.weight.grad is None for r in routers)
    assert model.get_input_embeddings().weight.grad is not None
    handle.remove()
    assert [r.weight.requires_grad for r in routers] == [True] * (len(routers) - 1) + [False]
    assert {n: p.requires_grad for n, p in model.named_parameters() if n in others} == others


def test_a_context_of_the_wrong_size_is_refused():
    model, _, pi, input_ids = make_case("qwen3_moe")
    model.train()
    handle = install_anchor(model, AnchorConfig(method="rpb"), prior=pi)
    with handle.step(SAMPLE_BT[:2], SPAN_BT[:2], MASK_BT[:2]), pytest.raises(RuntimeError, match="tokens"):
        forward(model, input_ids)
