"""rpb's experts kernel (``rpb_sorted``) against transformers' own per-expert loop (``eager``).

Every family of tiny model: the same weights run through both implementations give the same loss, logits
and gradients of every parameter (routing weights and expert weights included), with experts that receive no
token. With padding skipped (``token_mask``), the real tokens' logits and every gradient still equal the
eager model's on the padded batch, and greedy generation from left-padded prompts gives the same tokens.
Layouts and dtypes the kernel does not multiply run transformers' ``grouped_mm``.
"""

from __future__ import annotations

import copy

import pytest
import torch

from rpb.kernels import SORTED_EXPERTS, registered, supports, token_mask
from rpb.testing.models import ARCHITECTURES, build_tiny_model
from rpb.train.config import RunConfig, TrainSection, validate

VOCAB = 64
TOL = dict(rtol=1e-4, atol=1e-5)


def pair(arch: str, seed: int = 0, **overrides):
    """Two copies of one tiny model, in train mode: transformers' eager experts and rpb's."""
    eager = build_tiny_model(arch, VOCAB, seed=seed, **overrides).train()
    eager.set_experts_implementation("eager")
    fast = copy.deepcopy(eager)
    fast.set_experts_implementation(SORTED_EXPERTS)
    return eager, fast


def padded_batch(seed: int = 0, rows: int = 4, width: int = 12):
    gen = torch.Generator().manual_seed(seed)
    ids_BT = torch.randint(1, VOCAB, (rows, width), generator=gen)
    lengths = [width, width - 3, width - 7, 5][:rows]
    mask_BT = torch.zeros(rows, width, dtype=torch.long)
    for b, n in enumerate(lengths):
        mask_BT[b, :n] = 1
    labels_BT = torch.where(mask_BT > 0, ids_BT, torch.full_like(ids_BT, -100))
    return {"input_ids": ids_BT.masked_fill(mask_BT == 0, 0), "attention_mask": mask_BT, "labels": labels_BT}


def loss_logits_grads(model, batch):
    model.zero_grad(set_to_none=True)
    out = model(**batch)
    out.loss.backward()
    grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    return out.loss.detach(), out.logits.detach(), grads


def sorted_experts_modules(model):
    return [m for n, m in model.named_modules() if n.endswith("experts") and hasattr(m, "has_gate")]


FAST_ARCHS = [a for a in ARCHITECTURES if supports(sorted_experts_modules(build_tiny_model(a, VOCAB))[0])]


def test_the_kernel_covers_every_family_but_gpt_oss():
    # gpt-oss keeps biases and interleaved gate/up weights: transformers' grouped_mm runs it
    assert set(ARCHITECTURES) - set(FAST_ARCHS) == {"gpt_oss"}


@pytest.mark.parametrize("arch", FAST_ARCHS)
def test_same_loss_logits_and_gradients_as_eager(arch):
    eager, fast = pair(arch)
    batch = {k: v for k, v in padded_batch().items() if k != "attention_mask"}
    loss_e, logits_e, grads_e = loss_logits_grads(eager, batch)
    loss_f, logits_f, grads_f = loss_logits_grads(fast, batch)
    torch.testing.assert_close(loss_f, loss_e, **TOL)
    torch.testing.assert_close(logits_f, logits_e, **TOL)
    assert grads_f.keys() == grads_e.keys()
    routed = [n for n in grads_e if "experts" in n and ("gate_up_proj" in n or "down_proj" in n)]
    assert routed, "no expert weight got a gradient"
    for name in grads_e:
        torch.testing.assert_close(grads_f[name], grads_e[name], **TOL, msg=name)


def test_experts_without_tokens_get_zero_gradient():
    # 64 tokens over 8 experts, routed to experts 0-2 only: the others must get exactly zero (not garbage)
    _, fast = pair("qwen3_moe")
    experts = sorted_experts_modules(fast)[0]
    x_TH = torch.randn(64, experts.gate_up_proj.shape[-1], requires_grad=True)
    idx_TK = torch.stack([torch.randperm(3)[:2] for _ in range(64)])
    w_TK = torch.rand(64, 2, requires_grad=True)
    ref = copy.deepcopy(experts)
    ref.config = copy.copy(ref.config)
    ref.config._experts_implementation = "eager"
    for module in (experts, ref):
        module.gate_up_proj.grad = module.down_proj.grad = None
        module(x_TH, idx_TK, w_TK).square().sum().backward()
    for weight in ("gate_up_proj", "down_proj"):
        grad = getattr(experts, weight).grad
        assert torch.count_nonzero(grad[3:]) == 0
        torch.testing.assert_close(grad, getattr(ref, weight).grad, **TOL)


def test_two_runs_are_bit_identical_under_deterministic_kernels():
    from rpb.train.run import deterministic_algorithms

    _, fast = pair("moonlight")
    batch = padded_batch(seed=3)
    with deterministic_algorithms(True), token_mask(fast):
        first = loss_logits_grads(fast, batch)
        second = loss_logits_grads(fast, batch)
    assert torch.equal(first[0], second[0]) and torch.equal(first[1], second[1])
    assert all(torch.equal(first[2][n], second[2][n]) for n in first[2])


@pytest.mark.parametrize("arch", ["moonlight", "qwen3_moe", "mixtral"])
def test_skipping_padding_changes_no_real_token_and_no_gradient(arch):
    eager, fast = pair(arch)
    batch = padded_batch(seed=1)
    _, logits_e, grads_e = loss_logits_grads(eager, batch)
    calls = []
    experts = sorted_experts_modules(fast)[0]
    hook = experts.register_forward_hook(lambda m, args, out: calls.append(out.detach()))
    with token_mask(fast):
        _, logits_f, grads_f = loss_logits_grads(fast, batch)
    hook.remove()
    real_BT = batch["attention_mask"].bool()
    torch.testing.assert_close(logits_f[real_BT], logits_e[real_BT], **TOL)
    for name in grads_e:
        torch.testing.assert_close(grads_f[name], grads_e[name], **TOL, msg=name)
    # the padding got no expert output at all (it was skipped, not computed and discarded)
    pad_T = ~real_BT.reshape(-1)
    assert torch.count_nonzero(calls[0][pad_T]) == 0 and torch.count_nonzero(calls[0][~pad_T]) > 0


def test_left_padded_greedy_generation_gives_eagers_tokens():
    eager, fast = pair("moonlight", seed=2)
    eager.eval(), fast.eval()
    prompts = padded_batch(seed=4, width=9)
    ids_BT, mask_BT = prompts["input_ids"], prompts["attention_mask"]
    # left padding: each row's tokens moved to the end
    left_ids, left_mask = torch.zeros_like(ids_BT), torch.zeros_like(mask_BT)
    for b in range(ids_BT.shape[0]):
        n = int(mask_BT[b].sum())
        left_ids[b, -n:], left_mask[b, -n:] = ids_BT[b, :n], 1
    kw = dict(max_new_tokens=6, do_sample=False, pad_token_id=0, eos_token_id=None)
    expected = eager.generate(input_ids=left_ids, attention_mask=left_mask, **kw)
    with token_mask(fast):
        got = fast.generate(input_ids=left_ids, attention_mask=left_mask, **kw)
    assert torch.equal(got, expected)


def test_other_layouts_run_grouped_mm_and_float64_the_eager_loop():
    ref = build_tiny_model("gpt_oss", VOCAB).train()
    ref.set_experts_implementation("grouped_mm")
    fast = copy.deepcopy(ref)
    fast.set_experts_implementation(SORTED_EXPERTS)
    batch = {k: v for k, v in padded_batch().items() if k != "attention_mask"}
    assert torch.equal(loss_logits_grads(fast, batch)[1], loss_logits_grads(ref, batch)[1])
    eager, fast = pair("moonlight")
    eager.double(), fast.double()  # torch's CPU grouped_mm multiplies no float64: the eager loop
    torch.testing.assert_close(loss_logits_grads(fast, batch)[1], loss_logits_grads(eager, batch)[1])
    eager, fast = pair("qwen3_moe", moe_intermediate_size=6)  # rows of 24 bytes: grouped_mm refuses them
    torch.testing.assert_close(loss_logits_grads(fast, batch)[1], loss_logits_grads(eager, batch)[1])


def test_the_mask_hook_comes_off():
    _, fast = pair("moonlight")
    before = (len(fast._forward_pre_hooks), len(fast._forward_hooks))
    with token_mask(fast):
        assert len(fast._forward_pre_hooks) == before[0] + 1
    assert (len(fast._forward_pre_hooks), len(fast._forward_hooks)) == before


def test_rpb_train_names_an_unknown_experts_implementation():
    cfg = RunConfig(model="m", data_jsonl="", output_dir="o", train=TrainSection(experts_implementation="fastest"))
    problems = [p for p in validate(cfg) if p.startswith("train.experts_implementation")]
    assert problems == [f"train.experts_implementation: 'fastest' is not one of {registered()}"]
    assert SORTED_EXPERTS in registered() and "grouped_mm" in registered()
