"""The methods table is the one place a method lives: what each entry derives, and a method that
exists only in a test fixture running through the HF hook, the grids' weight search and the tables
(and, in ``tests/integrations/megatron``, the Megatron router)."""

from __future__ import annotations

import pytest
import torch

import rpb.anchors.methods as methods_module
from rpb.anchors import METHODS, AnchorConfig, get_method, install_anchor, methods_table
from rpb.errors import ArgumentError, ConfigError
from rpb.testing.models import build_tiny_model
from rpb.toyworld.study.grid import Arm, Grid, table_weights
from rpb.toyworld.study.tables import table
from rpb.train.config import load_config
from tests.anchors import dummy_method


@pytest.fixture
def dummy():
    with dummy_method.registered() as method:
        yield method


def test_needs_are_derived_from_each_entry():
    needs_prior = {m for m, e in METHODS.items() if e.needs_prior}
    transition = {"within-transition-soft", "within-transition-hard"}
    assert needs_prior == {"rpb", "rpb-hard", "within-soft", "within-hard", "global-hard", *transition}
    assert {m for m, e in METHODS.items() if e.needs_base_router} == {"router-l2", "kl-to-base", "logit-l2"}
    assert {m for m, e in METHODS.items() if e.needs_base_logits} == {"kl-to-base", "logit-l2"}
    assert {m for m, e in METHODS.items() if e.needs_communities} == {"within-soft", "within-hard", *transition}
    teachers = {"routing-kd": "routing", "output-kd": "output", "routing-kd-router": "routing", "hidden-kd": "routing"}
    assert {m for m, e in METHODS.items() if not e.in_paper} == transition | set(teachers)
    assert {m: e.teacher for m, e in METHODS.items() if e.teacher} == teachers
    assert {m: e.coefficient for m, e in METHODS.items() if e.coefficient} == {
        "lbl": "lbl_coef",
        "router-l2": "lambda_",
        "kl-to-base": "lambda_",
        "logit-l2": "lambda_",
        "routing-kd": "lambda_",
        "output-kd": "lambda_",
        "routing-kd-router": "lambda_",
        "hidden-kd": "lambda_",
    }
    assert get_method("routing-kd").loss.from_forward and get_method("output-kd").loss is None
    assert not get_method("router-l2").loss.from_forward and get_method("lbl").loss.from_forward


def test_the_docstring_shows_the_table_the_code_renders():
    assert methods_table() in methods_module.__doc__


def test_inconsistent_entries_are_refused(dummy):
    with pytest.raises(ArgumentError, match="exists"):
        methods_module.register_method(dummy)
    bad = methods_module.Method("odd", "x", loss=dummy.loss)
    with pytest.raises(ArgumentError, match="a loss and its coefficient go together"):
        methods_module.register_method(bad)


def test_a_registered_method_trains_through_the_hf_hook(dummy):
    """The hook dispatches to the entry's term: coefficient x mean over MoE layers of the term, each
    computed by hand on the logits the routers returned (captured by hooks of our own)."""
    model = build_tiny_model("qwen3_moe", vocab_size=32, seed=0).train()
    handle = install_anchor(model, AnchorConfig(method=dummy_method.NAME, lambda_=0.3))
    captured = []
    routers = [m for m in model.modules() if type(m).__name__ == "Qwen3MoeTopKRouter"]
    hooks = [r.register_forward_hook(lambda m, a, out: captured.append(out[0].detach())) for r in routers]
    ids = torch.randint(1, 32, (2, 5), generator=torch.Generator().manual_seed(0))
    mask = torch.tensor([[1, 1, 1, 1, 1], [1, 1, 1, 0, 0]])
    sample, span = torch.zeros_like(ids), torch.zeros_like(ids)
    with handle.step(sample, span, mask):
        model(input_ids=ids, attention_mask=mask)
        term = handle.loss()
        term.backward()
    for h in hooks:
        h.remove()
    valid = mask.reshape(-1).bool()
    expected = 0.3 * sum(dummy_method.by_hand(z, valid) for z in captured) / len(captured)
    assert len(captured) == len(routers) == 2
    assert float(term) == pytest.approx(expected, rel=1e-5)
    assert all(r.weight.grad is not None and r.weight.grad.abs().sum() > 0 for r in routers)
    handle.remove()


def test_a_registered_method_is_configurable_searched_and_tabled(dummy, tmp_path):
    path = tmp_path / "run.yaml"
    path.write_text(f"model: m\ndata_jsonl: {path}\noutput_dir: o\ntrain: {{max_seq_len: 8}}\n")
    path.write_text(path.read_text() + f"anchor: {{method: {dummy_method.NAME}}}\n")
    with pytest.raises(ConfigError, match=r"anchor.lambda: required by method 'logit-norm'"):
        load_config(path)
    assert load_config(path, ["anchor.lambda=0.1"]).anchor.coefficient() == 0.1
    # the grids try the entry's weights on the validation split
    grid = Grid("g", ("math_post",), (Arm("sft", "sft"), Arm(dummy_method.NAME, dummy_method.NAME)), (42,))
    assert grid.candidates[dummy_method.NAME] == dummy_method.WEIGHTS == table_weights()[dummy_method.NAME]
    # and the forms table lists it, because its entry says so
    retention = {"tvd": 0.1, "topk_overlap": 0.9, "nmi": 0.5}
    results = [
        {"set": "math_post", "arm": a, "method": a, "seed": 42, "id": 0.5, "ood": 0.25, "retention": retention}
        for a in ("sft", dummy_method.NAME)
    ]
    forms = table("forms", results, ("math_post",), ("sft", dummy_method.NAME))
    assert f"| {dummy_method.NAME} | 50.0 | 25.0 | 0.100 | 0.900 |" in forms
    assert dummy_method.NAME not in table("controls", results, ("math_post",), ("sft", dummy_method.NAME))
    assert f"`{dummy_method.NAME}`" in methods_table()


# ---- routing-kd's stored-routes forms (rpb.losses) --------------------------------------------------------------


@pytest.mark.parametrize("transform", ["softmax", "sigmoid-normalized"])
def test_the_bucket_form_is_0_at_the_base_and_with_every_expert_stored_is_online_routing_kds_kl(transform):
    from rpb import losses
    from rpb.prior import router_probs

    gen = torch.Generator().manual_seed(3)
    base_TE, now_TE = torch.randn(7, 8, generator=gen), torch.randn(7, 8, generator=gen)
    valid_T = torch.tensor([1, 1, 0, 1, 1, 1, 1], dtype=torch.bool)
    q_TE = router_probs(base_TE, transform)
    top_TK = q_TE.topk(3, dim=-1).indices
    stored = (top_TK, q_TE.gather(-1, top_TK))
    assert float(losses.routing_kd_bucket(base_TE, *stored, valid_T, transform)) == pytest.approx(0.0, abs=1e-7)
    # by hand: three stored cells and the rest, averaged over the valid tokens
    p_TE = router_probs(now_TE, transform).double()
    q3, p3 = stored[1].double(), p_TE.gather(-1, top_TK)
    hand_T = (q3 * (q3 / p3).log()).sum(-1) + (1 - q3.sum(-1)) * ((1 - q3.sum(-1)) / (1 - p3.sum(-1))).log()
    got = losses.routing_kd_bucket(now_TE, *stored, valid_T, transform)
    assert float(got) == pytest.approx(float(hand_T[valid_T].mean()), rel=1e-5)
    # every expert stored (in any order): no rest, and the term and its gradient are the online KL's
    every_TE = torch.stack([torch.randperm(8, generator=gen) for _ in range(7)])
    a, b = now_TE.clone().requires_grad_(), now_TE.clone().requires_grad_()
    whole = losses.routing_kd_bucket(a, every_TE, q_TE.gather(-1, every_TE), valid_T, transform)
    online = losses.kl_to_base(b, base_TE, valid_T, transform)
    whole.backward(), online.backward()
    # float32 sums in another order, and a rest of ~1e-7 in place of 0: equal to a few ulps of the term
    assert float(whole) == pytest.approx(float(online), rel=1e-5)
    assert torch.allclose(a.grad, b.grad, atol=1e-6)


def test_the_ids_alone_hinge_is_the_rules_margin_worked_by_hand():
    """Four experts, top-2, no groups (softmax: the margin on the logits): the base chose {0, 1}."""
    from rpb import losses
    from rpb.routing import RouterSpec

    spec = RouterSpec("softmax", top_k=2, num_experts=4)
    base_TK = torch.tensor([[0, 1], [0, 1], [0, 1]])
    z_TE = torch.tensor([[3.0, 2.0, 1.0, 0.0],  # the rule still picks {0, 1}: 0
                         [3.0, 1.0, 1.5, 0.0],  # expert 2 (1.5) beats the base's weakest (1.0): 0.5
                         [0.0, 2.0, 1.0, 4.0]],  # expert 3 (4.0) beats the weakest (0.0): 4.0
                        requires_grad=True)  # fmt: skip
    valid_T = torch.tensor([True, True, True])
    term, active_T = losses.routing_kd_hinge(z_TE, base_TK, valid_T, spec)
    assert float(term.detach()) == pytest.approx((0 + 0.5 + 4.0) / 3) and active_T.tolist() == [False, True, True]
    term.backward()  # only the weakest base expert rises and the strongest rival falls, on the active tokens
    want = torch.tensor([[0, 0, 0, 0], [0, -1 / 3, 1 / 3, 0], [-1 / 3, 0, 0, 1 / 3]])
    torch.testing.assert_close(z_TE.grad, want)
    # the padding token is neither counted nor active
    term, active_T = losses.routing_kd_hinge(z_TE, base_TK, torch.tensor([True, True, False]), spec)
    assert float(term) == pytest.approx(0.25) and active_T.tolist() == [False, True, False]


def test_the_ids_alone_hinge_holds_the_groups_and_the_correction_bias_worked_by_hand():
    """Sigmoid scores plus a correction bias, 3 groups of 2, the two best groups by their top-2 sum, top-2; the base
    chose experts 0 and 1 (group 0 alone, so one more group is kept beside it)."""
    from rpb import losses
    from rpb.routing import RouterSpec, select

    spec = RouterSpec("sigmoid", top_k=2, num_experts=6, group_scoring="top2-sum", num_groups=3, topk_groups=2)
    bias_E = torch.tensor([0.0, 0.0, 0.5, 0.0, 0.0, 0.0])
    s = torch.tensor(
        [
            [0.9, 0.8, 0.2, 0.1, 0.3, 0.3],  # groups 1.7, 0.8, 0.6: the rule picks {0, 1}: 0
            [0.5, 0.2, 0.6, 0.1, 0.4, 0.4],  # scores with the bias: 0.5 0.2 | 1.1 0.1 | 0.4 0.4
            [0.9, 0.8, 0.35, 0.0, 0.5, 0.45],
        ]
    )  # with the bias: 0.9 0.8 | 0.85 0.0 | 0.5 0.45
    z_TE = torch.logit(s).requires_grad_()
    base_TK = torch.tensor([[0, 1], [0, 1], [0, 1]])
    valid_T = torch.tensor([True, True, True])
    assert select(z_TE.detach(), spec, expert_bias_E=bias_E)[[0, 2]].sort(-1).values.tolist() == [[0, 1], [0, 1]]
    term, active_T = losses.routing_kd_hinge(z_TE, base_TK, valid_T, spec, bias_E)
    # token 1: groups 0.7, 1.2, 0.8 keep groups 1 and 2, so group 0 (0.7) must beat the best other group but one
    # (0.8, the 2 - 1 + 1 = 2nd best): 0.1; the rivals are the kept groups' experts, best 2 at 1.1 against the base's
    # weakest, expert 1 at 0.2: 0.9. Token 2: expert 2 (0.85) outscores the base's 0.8, but its group (0.85) loses
    # to group 2 (0.95), so the rule never sees it: 0
    assert active_T.tolist() == [False, True, False]
    assert float(term.detach()) == pytest.approx((0.1 + 0.9) / 3, abs=1e-6)
    refused = RouterSpec("softmax", 2, 6, group_scoring="top2-sum", num_groups=3, topk_groups=2)
    with pytest.raises(ValueError, match="top2-sum over softmax scores rank otherwise"):
        losses.routing_kd_hinge(z_TE, base_TK, valid_T, refused)
