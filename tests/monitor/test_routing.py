"""The monitor's figures against a hand computation: a checkpoint whose routers were moved by a known amount,
observed on one forward, every figure recomputed in float64 from the hidden states the routers saw."""

from __future__ import annotations

import logging
import math

import pytest
import torch

from rpb.adapters import find_moe_layers, get_adapter
from rpb.errors import ArgumentError
from rpb.monitor import FIGURES, MonitorConfig, RoutingMonitor
from rpb.testing.models import ARCHITECTURES, build_tiny_model

pytestmark = pytest.mark.usefixtures("one_thread")


def hand_figures(h_TH, w0_EH, w1_EH, k):
    """Qwen3-MoE's rule (softmax, top-k) on the base and the moved router, per the module doc's formulas."""
    z0, z1 = h_TH.double() @ w0_EH.double().T, h_TH.double() @ w1_EH.double().T
    p0, p1 = torch.softmax(z0, -1), torch.softmax(z1, -1)
    ids0, ids1 = p0.topk(k, -1).indices.tolist(), p1.topk(k, -1).indices.tolist()
    overlap = sum(len(set(a) & set(b)) for a, b in zip(ids0, ids1, strict=True)) / (k * len(ids0))
    kl = float((p0 * (p0.log() - p1.log())).sum(-1).mean())
    E = w0_EH.shape[0]
    counts = [sum(e in row for row in ids1) for e in range(E)]
    total, mean = sum(counts), sum(counts) / E
    shares = [c / total for c in counts]
    return {
        "topk_overlap": overlap,
        "kl": kl,
        "load_cv": math.sqrt(sum((c - mean) ** 2 for c in counts) / E) / mean,
        "max_share": max(shares),
        "dead_fraction": sum(c == 0 for c in counts) / E,
        "entropy": -sum(s * math.log(s) for s in shares if s > 0) / math.log(E),
    }


def test_figures_equal_the_hand_computation_on_moved_routers():
    model = build_tiny_model("qwen3_moe", vocab_size=64, seed=3)
    monitor = RoutingMonitor(model, MonitorConfig(per_layer=True)).attach()  # the base's routers, frozen here
    layers = find_moe_layers(model, get_adapter("qwen3_moe"))
    base = [m.router.weight.detach().clone() for m in layers]
    gen = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for m in layers:  # the fine-tune's drift: a known move of every router
            m.router.weight.add_(torch.randn(m.router.weight.shape, generator=gen) * 0.5)
    seen = []
    hooks = [
        m.router.register_forward_hook(lambda mod, a, o: seen.append(a[0].reshape(-1, a[0].shape[-1]))) for m in layers
    ]
    ids = torch.randint(1, 64, (2, 12), generator=gen)
    labels = ids.clone()
    labels[:, :5] = -100  # the prompt: not a loss token, not observed
    with torch.no_grad():
        model(input_ids=ids, labels=labels)
    for h in hooks:
        h.remove()
    figures = monitor.flush()
    keep = (labels != -100).reshape(-1)
    for m, w0, h_TH in zip(layers, base, seen, strict=True):
        want = hand_figures(h_TH[keep], w0, m.router.weight.detach(), m.router.top_k)
        got = {name: figures[f"routing/layer_{m.layer_index}/{name}"] for name in FIGURES}
        assert got == pytest.approx(want, rel=1e-6, abs=1e-9), m.layer_index
        assert 0 < want["topk_overlap"] < 1 and want["kl"] > 0  # the move changed something
    means = [figures[f"routing/layer_{m.layer_index}/kl"] for m in layers]
    assert figures["routing/mean/kl"] == pytest.approx(sum(means) / len(means))
    assert monitor.flush() == {}  # the window restarted


def test_unmoved_routers_agree_with_the_base_exactly():
    model = build_tiny_model("moonlight", vocab_size=64, seed=1)  # sigmoid, expert-correction bias, groups
    monitor = RoutingMonitor(model).attach()
    with torch.no_grad():
        model(input_ids=torch.randint(1, 64, (2, 9)))
    figures = monitor.flush()
    assert figures["routing/min/topk_overlap"] == 1.0 and figures["routing/max/kl"] == pytest.approx(0.0, abs=1e-12)
    monitor.remove()


def test_with_an_anchor_installed_the_monitor_reads_its_taps_and_keeps_its_own_window():
    """No hook of the monitor's own on the routers; the same figures as a monitor hooking them itself; the
    anchor's reset (at every log) leaves the monitor's window alone; eval-mode forwards are not tapped."""
    from rpb.anchors import AnchorConfig, install_anchor

    model = build_tiny_model("qwen3_moe", vocab_size=64, seed=3).train()
    layers = find_moe_layers(model, get_adapter("qwen3_moe"))
    E = layers[0].router.weight.shape[0]
    gen = torch.Generator().manual_seed(0)
    prior = torch.softmax(torch.randn(2, 2, len(layers), E, generator=gen) * 3, -1)
    handle = install_anchor(model, AnchorConfig(method="rpb", beta=4.0), prior=prior, record_stats=True)
    tapped = RoutingMonitor(model, anchor=handle).attach()
    assert [len(m.router._forward_hooks) for m in layers] == [1] * len(layers)  # the anchor's hook alone
    own = RoutingMonitor(model).attach()
    with torch.no_grad():
        for m in layers:
            m.router.weight.add_(torch.randn(m.router.weight.shape, generator=gen) * 0.5)
    ids = torch.randint(1, 64, (2, 12), generator=gen)
    labels = ids.clone()
    labels[:, :5] = -100
    span = torch.where(labels == -100, -1, 1)
    sample = torch.arange(2)[:, None].expand(2, 12)
    with torch.no_grad(), handle.step(sample, span, torch.ones_like(ids)):
        model(input_ids=ids, labels=labels)
    assert handle.reset_stats()[0].changed > 0  # the anchor did change selections: the tap gave the router's own
    tapped_figures, own_figures = tapped.flush(), own.flush()
    assert tapped_figures["routing/min/topk_overlap"] < 1
    assert tapped_figures == pytest.approx(own_figures, rel=1e-9)
    model.eval()
    with torch.no_grad():
        model(input_ids=ids, labels=labels)
    assert tapped.flush() == {}
    tapped.remove()
    assert handle.taps == []
    handle.remove()


def moved(model, arch, scale=0.5, only=None, seed=0):
    """The model's MoE layers, their base router weights, and the routers moved by a seeded amount (every
    layer, or the positions in ``only``)."""
    layers = find_moe_layers(model, get_adapter(arch))
    base = [m.router.weight.detach().clone() for m in layers]
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for pos, m in enumerate(layers):
            step = torch.randn(m.router.weight.shape, generator=gen) * scale
            if only is None or pos in only:
                m.router.weight.add_(step)
    return layers, base


class Hidden:
    """Each router's input on the last forward, [tokens, hidden]."""

    def __init__(self, layers):
        self.seen = [None] * len(layers)
        self.hooks = [m.router.register_forward_hook(self._hook(i)) for i, m in enumerate(layers)]

    def _hook(self, i):
        def hook(mod, args, out):
            self.seen[i] = args[0].reshape(-1, args[0].shape[-1]).detach().clone()

        return hook

    def remove(self):
        for h in self.hooks:
            h.remove()


def test_forwards_without_labels_count_attended_tokens_said_once_and_a_given_mask_narrows_them(caplog):
    """No labels: every attended token, one warning per monitor; ``tokens(mask)``: exactly the mask's tokens
    (a GRPO step's completions), against the hand computation on them."""
    model = build_tiny_model("qwen3_moe", vocab_size=64, seed=3)
    monitor = RoutingMonitor(model, MonitorConfig(per_layer=True)).attach()
    layers, base = moved(model, "qwen3_moe")
    hidden = Hidden(layers)
    gen = torch.Generator().manual_seed(1)
    ids = torch.randint(1, 64, (2, 10), generator=gen)
    attention = torch.ones_like(ids)
    attention[1, 7:] = 0  # padding
    completion = torch.zeros_like(ids, dtype=torch.bool)
    completion[0, 4:], completion[1, 5:7] = True, True  # the completion tokens, prompts and padding left out
    with caplog.at_level(logging.WARNING, logger="rpb.monitor"), torch.no_grad():
        for keep_BT in (attention.bool(), completion):
            for _ in range(2):
                if keep_BT is completion:
                    with monitor.tokens(completion):
                        model(input_ids=ids, attention_mask=attention)
                else:
                    model(input_ids=ids, attention_mask=attention)
            figures = monitor.flush()
            keep = keep_BT.reshape(-1)
            for m, w0, h_TH in zip(layers, base, hidden.seen, strict=True):
                twice = torch.cat([h_TH[keep], h_TH[keep]])  # two forwards in the window
                want = hand_figures(twice, w0, m.router.weight.detach(), m.router.top_k)
                got = {name: figures[f"routing/layer_{m.layer_index}/{name}"] for name in FIGURES}
                assert got == pytest.approx(want, rel=1e-6, abs=1e-9), (keep_BT is completion, m.layer_index)
    said = [r.getMessage() for r in caplog.records if "without labels" in r.getMessage()]
    assert len(said) == 1 and "every attended token" in said[0] and "RoutingMonitor.tokens" in said[0]
    wrong = r"the mask has shape \(2, 9\), the forward's input_ids \(2, 10\)"
    with pytest.raises(ArgumentError, match=wrong), monitor.tokens(completion[:, :9]), torch.no_grad():
        model(input_ids=ids)
    hidden.remove()
    monitor.remove()


def test_alarms_name_the_layer_that_crossed():
    """Only the second MoE layer collapses (every token to experts 0 and 1): the overlap and dead-share alarms
    name its decoder layer index; the KL jump says it is the mean over layers."""
    from tests.monitor.test_callback import collapse_hook

    model = build_tiny_model("qwen3_moe", vocab_size=64, seed=3)
    config = MonitorConfig(min_overlap=0.99, max_dead_fraction=0.5, max_kl_jump=1e-6)
    monitor = RoutingMonitor(model, config).attach()
    ids = torch.randint(1, 64, (2, 12), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        model(input_ids=ids)
    assert monitor.alarms(monitor.flush()) == []  # the base: nothing crossed
    layers = find_moe_layers(model, get_adapter("qwen3_moe"))
    collapse_hook(layers[1].router)
    with torch.no_grad():
        model(input_ids=ids)
    figures = monitor.flush()
    index = layers[1].layer_index
    assert index != layers[0].layer_index and figures["routing/max/dead_fraction"] == 0.75  # 6 of 8 unused
    assert monitor.alarms(figures) == [
        f"layer {index}'s top-k overlap with the base fell to {figures['routing/min/topk_overlap']:.3f} "
        "(alarm below 0.99)",
        f"layer {index} left 0.750 of its experts unused (alarm above 0.5)",
        f"the KL from the base, mean over the MoE layers, jumped {figures['routing/mean/kl']:.4f} in one window "
        "(alarm above 1e-06)",
    ]
    monitor.last_layers = {"dead_fraction": {0: 0.6, 3: 0.8, 5: 0.4, 7: 0.7}}  # several layers past the alarm
    assert monitor.alarms({"routing/max/dead_fraction": 0.8}) == [
        "layer 3 left 0.800 of its experts unused (alarm above 0.5; layers 0, 7 too)"
    ]
    monitor.remove()


@pytest.mark.parametrize(
    ("arch", "given", "other"),
    [
        ("moonlight", None, "softmax"),  # a sigmoid family, no prior, no setting: the family's normalised sigmoid
        ("qwen3_moe", "sigmoid-normalized", "softmax"),  # the anchor's setting (a prior's, as rpb train resolves)
    ],
)
def test_the_monitors_kl_is_the_quantity_kl_to_base_minimises(arch, given, other):
    """The anchor's term, the monitor reading its taps and a hand KL of the anchor's transform agree (the
    other transform's KL would differ)."""
    from rpb.anchors import AnchorConfig, install_anchor

    model = build_tiny_model(arch, vocab_size=64, seed=1).train()
    handle = install_anchor(model, AnchorConfig(method="kl-to-base", lambda_=1.0, router_transform=given))
    monitor = RoutingMonitor(model, anchor=handle).attach()
    assert monitor.transform == "sigmoid-normalized"
    layers, base = moved(model, model.config.model_type, scale=0.3)
    hidden = Hidden(layers)
    ids = torch.randint(1, 64, (2, 9), generator=torch.Generator().manual_seed(4))
    sample = torch.arange(2)[:, None].expand(2, 9)
    with torch.no_grad(), handle.step(sample, torch.ones_like(ids), torch.ones_like(ids)):
        model(input_ids=ids, labels=ids)
        loss = float(handle.loss())
    kl = monitor.flush()["routing/mean/kl"]

    def probs(z, transform):
        return torch.softmax(z, -1) if transform == "softmax" else torch.sigmoid(z) / torch.sigmoid(z).sum(-1, True)

    def hand(transform):
        per_layer = []
        for m, w0, h_TH in zip(layers, base, hidden.seen, strict=True):
            p0 = probs(h_TH.double() @ w0.double().T, transform)
            p1 = probs(h_TH.double() @ m.router.weight.detach().double().T, transform)
            per_layer.append(float((p0 * (p0.log() - p1.log())).sum(-1).mean()))
        return sum(per_layer) / len(per_layer)

    assert kl == pytest.approx(hand("sigmoid-normalized"), rel=1e-5) and loss == pytest.approx(kl, rel=1e-4)
    assert abs(hand(other) - kl) > 0.05 * kl
    hidden.remove()
    monitor.remove()
    handle.remove()


def test_a_bare_monitor_reads_its_setting_else_the_familys(caplog):
    from rpb.anchors import AnchorConfig, install_anchor

    model = build_tiny_model("moonlight", vocab_size=64, seed=1)
    assert RoutingMonitor(model).transform == "sigmoid-normalized"  # DeepSeek-V3's sigmoid routers
    assert RoutingMonitor(model, MonitorConfig(router_transform="softmax")).transform == "softmax"
    with pytest.raises(ArgumentError, match=r"MonitorConfig\.router_transform: one of"):
        RoutingMonitor(model, MonitorConfig(router_transform="sigmoid"))
    handle = install_anchor(model, AnchorConfig(method="kl-to-base", lambda_=1.0))
    with caplog.at_level(logging.WARNING, logger="rpb.monitor"):
        assert RoutingMonitor(model, MonitorConfig(router_transform="softmax"), anchor=handle).transform == "softmax"
    assert "KL read as softmax, while the anchor's kl-to-base reads sigmoid-normalized" in caplog.text
    handle.remove()


def test_a_kl_below_zero_by_rounding_is_zero():
    """The KL summed in floating point can land a hair below 0 (-4.1e-9 was logged): a KL never is."""
    from rpb.monitor.routing import layer_figures

    tokens_L = torch.tensor([10.0, 10.0], dtype=torch.float64)
    figures = layer_figures(tokens_L, tokens_L, torch.tensor([-4.1e-8, 3e-3], dtype=torch.float64),
                            torch.ones((2, 4), dtype=torch.float64))  # fmt: skip
    assert figures["kl"][0] == 0.0 and figures["kl"][1] == pytest.approx(3e-4)


def anchored_step_beside_the_base(model, base, handle, monitor, facts, ids, labels):
    """One anchored forward of ``model`` (its base routing from ``handle``'s teacher) and one eval forward of the
    checkpoint ``base`` on ``ids``: each MoE layer's (router logits, top-k ids) as each router returned them (hooks
    of the test's own, the model's first so the anchor cannot change what they read), and the monitor's figures."""
    seen, own = {}, {}

    def keep(into, p):
        return lambda mod, a, out: into.__setitem__(p, (out[0].detach(), out[2].detach()))

    hooks = [m.router.register_forward_hook(keep(seen, p), prepend=True)
             for p, m in enumerate(find_moe_layers(model, facts))]  # fmt: skip
    hooks += [m.router.register_forward_hook(keep(own, p)) for p, m in enumerate(find_moe_layers(base, facts))]
    with torch.no_grad():
        base(input_ids=ids)
    sample = torch.zeros_like(ids)
    with handle.step(sample, torch.ones_like(ids), torch.ones_like(ids)) as ctx:
        ctx.base = handle.base_routing({"input_ids": ids}, sample)
        with torch.no_grad():
            model(input_ids=ids, labels=labels)
    for h in hooks:
        h.remove()
    return seen, own, monitor.flush()


def test_with_the_base_forward_at_hand_the_routing_drift_is_read_against_the_bases_own_routing(save_tiny):
    """routing-kd's online base: the monitor adds the base's routing on its own hidden states against the model's,
    read against two forwards by hand (the router's drift figures stay on the current hidden states)."""
    from rpb.anchors import AnchorConfig, install_anchor
    from rpb.models import load_causal_lm
    from rpb.teacher import online_base

    model_dir = save_tiny("qwen3_moe")
    model = load_causal_lm(str(model_dir)).train()
    facts = get_adapter("qwen3_moe")
    handle = install_anchor(model, AnchorConfig(method="routing-kd", lambda_=1.0, router_transform="softmax"))
    handle.teacher = online_base(model, facts, model_id=str(model_dir), dtype=None, outputs=False)
    gen = torch.Generator().manual_seed(2)
    with torch.no_grad():  # the hidden states drift, the routers do not: the router figures stay at the base's
        for name, p in model.named_parameters():
            if "self_attn" in name:
                p.add_(torch.randn(p.shape, generator=gen) * 0.5 * p.std())
    monitor = RoutingMonitor(model, anchor=handle).attach()
    ids = torch.randint(5, 60, (2, 9), generator=gen)
    labels = ids.clone()
    labels[:, :3] = -100
    base = load_causal_lm(str(model_dir)).eval()
    seen, own, figures = anchored_step_beside_the_base(model, base, handle, monitor, facts, ids, labels)
    keep = (labels != -100).reshape(-1)
    overlaps, kls = [], []
    for pos in sorted(seen):
        q, p = torch.softmax(own[pos][0][keep].double(), -1), torch.softmax(seen[pos][0][keep].double(), -1)
        k = ARCHITECTURES["qwen3_moe"][1]["num_experts_per_tok"]
        top_q, top_p = q.topk(k, -1).indices, p.topk(k, -1).indices  # qwen3_moe: plain top-k of the softmax
        overlaps.append((top_p[:, :, None] == top_q[:, None, :]).any(-1).sum(-1).double().mean() / k)
        kls.append((q * (q.log() - p.log())).sum(-1).mean())
    assert figures["routing/mean/topk_overlap"] == 1.0  # the routers have not moved
    assert figures["routing/mean/base_forward_topk_overlap"] == pytest.approx(float(torch.stack(overlaps).mean()))
    assert figures["routing/mean/base_forward_kl"] == pytest.approx(float(torch.stack(kls).mean()), rel=1e-4)
    assert figures["routing/mean/base_forward_kl"] > 1e-4
    monitor.remove()
    handle.remove()


def deepseek_v3_topk(logits_TE, bias_E, groups: int, kept_groups: int, k: int) -> list[set[int]]:
    """DeepSeek-V3's rule written out: sigmoid scores plus the correction bias, a group's score the sum of its two
    best, the best ``kept_groups`` groups kept, then the top k of their experts."""
    scores = torch.sigmoid(logits_TE.double()) + bias_E.double()
    out = []
    for row in scores.tolist():
        size = len(row) // groups
        group_score = [sum(sorted(row[g * size : (g + 1) * size])[-2:]) for g in range(groups)]
        kept = sorted(range(groups), key=lambda g: -group_score[g])[:kept_groups]
        allowed = [e for e in range(len(row)) if e // size in kept]
        out.append(set(sorted(allowed, key=lambda e: -row[e])[:k]))
    return out


def test_the_base_forward_overlap_on_a_family_with_bias_and_groups_is_the_routers_own(save_tiny):
    """DeepSeek-V3 with a correction bias and expert groups: the base's choice on its own forward is the base
    router's own top-k (its frozen bias included), read here by hooks on each router's returned ids; a rule
    without the bias would choose otherwise on this case."""
    from rpb.anchors import AnchorConfig, install_anchor
    from rpb.models import load_causal_lm
    from rpb.teacher import online_base

    arch = "deepseek_v3_grouped"
    model_dir = save_tiny(arch)
    config = ARCHITECTURES[arch][1]
    groups, kept_groups, k = config["n_group"], config["topk_group"], config["num_experts_per_tok"]
    model = load_causal_lm(str(model_dir)).train()
    facts = get_adapter("deepseek_v3")
    handle = install_anchor(model, AnchorConfig(method="routing-kd", lambda_=1.0))
    handle.teacher = online_base(model, facts, model_id=str(model_dir), dtype=None, outputs=False)
    gen = torch.Generator().manual_seed(4)
    with torch.no_grad():  # the hidden states drift, the routers do not
        for name, p in model.named_parameters():
            if "self_attn" in name:
                p.add_(torch.randn(p.shape, generator=gen) * 0.5 * p.std())
    monitor = RoutingMonitor(model, anchor=handle).attach()
    ids = torch.randint(5, model.config.vocab_size, (2, 16), generator=gen)
    labels = ids.clone()
    labels[:, :4] = -100
    base = load_causal_lm(str(model_dir)).eval()
    base_layers = find_moe_layers(base, facts)
    now, own, figures = anchored_step_beside_the_base(model, base, handle, monitor, facts, ids, labels)
    counted = (labels != -100).reshape(-1)
    overlaps, unbiased = [], []
    for pos, layer in enumerate(base_layers):
        mine = [set(r) for r in now[pos][1][counted].tolist()]
        theirs = [set(r) for r in own[pos][1][counted].tolist()]
        logits, bias = own[pos][0][counted], layer.router.e_score_correction_bias
        assert bias.abs().sum() > 0 and groups > kept_groups  # the case has both
        assert deepseek_v3_topk(logits, bias, groups, kept_groups, k) == theirs  # the rule above is the router's
        without = deepseek_v3_topk(logits, torch.zeros_like(bias), groups, kept_groups, k)
        overlaps.append(sum(len(a & b) for a, b in zip(mine, theirs, strict=True)) / (k * len(mine)))
        unbiased.append(sum(len(a & b) for a, b in zip(mine, without, strict=True)) / (k * len(mine)))
    assert figures["routing/mean/topk_overlap"] == 1.0  # the routers have not moved
    figure = figures["routing/mean/base_forward_topk_overlap"]
    assert figure == pytest.approx(sum(overlaps) / len(overlaps), abs=1e-12)
    assert abs(figure - sum(unbiased) / len(unbiased)) > 0.02, "the case does not tell the bias's part"
    monitor.remove()
    handle.remove()
