"""``token_weights_BC`` against TRL's own ``GRPOTrainer._compute_loss`` (the installed release), every ``loss_type``.

The micro-batch carries no ``old_per_token_logps``, so TRL's importance ratio is exactly 1 and each token's loss is a
hand formula of its advantage (and, for ``cispo``/``vespo``, of its log-prob). TRL's log-probs are replaced by chosen
leaf tensors, so the check covers the value (``loss == sum(per_token_loss_BC * w_BC)``) and, token by token, the
gradient (``d loss / d logp_BC == w_BC * d per_token_loss_BC / d logp_BC``), which a row-sum check alone would miss.
"""

from __future__ import annotations

import datasets
import pytest
import torch
import trl

from rpb.integrations.trl.scaling import SCALING, documented_loss_types, token_weights_BC
from rpb.testing.models import build_tiny_model
from rpb.testing.tokenizers import moonlight_tokenizer

pytestmark = pytest.mark.usefixtures("one_thread")

PROMPT_LEN = 4
#: float64 throughout, but TRL builds sapo's temperatures as float32 scalars: float32 rounding, far below any
#: normaliser a wrong weight would add or drop (a factor of B, A, S or a length)
CLOSE = dict(rtol=1e-6, atol=1e-9)

#: name -> (per-device batch B, gradient_accumulation_steps A, steps_per_generation S, num_generations,
#: max_completion_length, completion positions C, which of the S micro-batches is scored). max_completion_length
#: exceeds C so that dr_grpo's constant is not the padded width; A != S so that the global-token rescaling shows.
CASES = {
    "one-step": (2, 1, 1, 2, 8, 5, 0),
    "accumulated": (3, 2, 4, 3, 7, 5, 2),
    "split-generation": (4, 3, 2, 4, 9, 6, 1),
}


@pytest.fixture(scope="module")
def tok():
    t = moonlight_tokenizer()
    t.padding_side = "left"
    return t


def plain_trainer(tok, tmp_path, loss_type, case, **overrides) -> trl.GRPOTrainer:
    B, A, S, G, max_len, _, _ = CASES[case]
    args = trl.GRPOConfig(
        output_dir=str(tmp_path),
        per_device_train_batch_size=B,
        gradient_accumulation_steps=A,
        steps_per_generation=S,
        num_generations=G,
        max_completion_length=max_len,
        loss_type=loss_type,
        beta=0.0,
        bf16=False,
        router_aux_loss_coef=0.0,
        report_to=[],
        use_cpu=True,
        save_strategy="no",
        disable_tqdm=True,
        **overrides,
    )
    model = build_tiny_model("qwen3_moe", len(tok), seed=0).train()
    data = datasets.Dataset.from_list([{"prompt": p} for p in ["abc", "de", "fgh", "ij"]])
    trainer = trl.GRPOTrainer(
        model, lambda completions, **kw: [0.0] * len(completions), args, data, processing_class=tok
    )
    # what the training loop sets before each window (transformers' Trainer, len(batch_samples))
    trainer.current_gradient_accumulation_steps = A
    assert trainer.model.training and not trainer.aux_loss_enabled and trainer.beta == 0.0
    return trainer


def generation_batch(case, seed=0):
    """The generation batch's completion mask (right-padded, lengths 0..C) and one micro-batch of it, as TRL
    splits it: ``num_items_in_batch`` is the active tokens of the whole generation batch, as TRL makes it."""
    B, _, S, _, _, C, k = CASES[case]
    g = torch.Generator().manual_seed(seed)
    lengths_N = torch.randint(0, C + 1, (B * S,), generator=g)
    lengths_N[k * B] = C  # one full row, one short row and (below) one empty row in the scored micro-batch
    lengths_N[k * B + 1] = 1
    if B > 2:
        lengths_N[k * B + 2] = 0
    mask_NC = (torch.arange(C) < lengths_N[:, None]).long()
    rows = slice(k * B, (k + 1) * B)
    prompt_lengths_B = torch.arange(B) % (PROMPT_LEN - 1) + 2
    prompt_mask_BP = (torch.arange(PROMPT_LEN) >= PROMPT_LEN - prompt_lengths_B[:, None]).long()  # left-padded
    advantages_B = torch.linspace(-1.3, 1.1, B, dtype=torch.float64)[torch.randperm(B, generator=g)]
    return {
        "prompt_ids": torch.randint(5, 40, (B, PROMPT_LEN), generator=g) * prompt_mask_BP,
        "prompt_mask": prompt_mask_BP,
        "completion_ids": torch.randint(5, 40, (B, C), generator=g) * mask_NC[rows],
        "completion_mask": mask_NC[rows],
        "advantages": advantages_B,
        "num_items_in_batch": mask_NC.sum(),
    }


def chosen_logps(trainer, B, C, seed=1) -> torch.Tensor:
    """TRL's log-probs replaced by a leaf tensor whose gradient the loss fills."""
    logps_BC = -0.1 - torch.rand(B, C, generator=torch.Generator().manual_seed(seed), dtype=torch.float64)
    logps_BC.requires_grad_(True)
    trainer._get_per_token_logps_and_entropies = lambda *a, **kw: (logps_BC, torch.zeros_like(logps_BC), None)
    return logps_BC


def hand_per_token(trainer, loss_type, advantages_B, logps_BC):
    """At ratio 1, TRL's per-token loss (grpo_trainer.py, ``_compute_loss``) and its derivative in the log-prob."""
    adv_B1 = advantages_B[:, None]
    logps_BC = logps_BC.detach()
    if loss_type == "cispo":  # -min(ratio, eps_high).detach() * adv * logp
        clamp = min(1.0, trainer.epsilon_high)
        return -clamp * adv_B1 * logps_BC, (-clamp * adv_B1).expand_as(logps_BC)
    if loss_type == "vespo":  # -phi(1) * adv * logp, phi(w) = exp(lambda + k log w - lambda w) = 1 at w = 1, detached
        return -adv_B1 * logps_BC, (-adv_B1).expand_as(logps_BC)
    if loss_type == "sapo":  # -sigmoid(tau (r - 1)) * 4 / tau * adv: 2 / tau at r = 1, slope sigmoid'(0) * 4 = 1
        tau_B1 = torch.where(adv_B1 > 0, trainer.args.sapo_temperature_pos, trainer.args.sapo_temperature_neg)
        return (-2.0 / tau_B1 * adv_B1).expand_as(logps_BC), (-adv_B1).expand_as(logps_BC)
    # -min(r adv, clip(r) adv): -adv at r = 1 (inside the clip range), slope -adv
    return (-adv_B1).expand_as(logps_BC), (-adv_B1).expand_as(logps_BC)


def scored(trainer, loss_type, case):
    """TRL's loss and its gradient in the log-probs, against the hand per-token loss weighted by token_weights_BC."""
    inputs = generation_batch(case)
    B, C = inputs["completion_mask"].shape
    logps_BC = chosen_logps(trainer, B, C)
    loss = trainer._compute_loss(trainer.model, inputs)
    (grad_BC,) = torch.autograd.grad(loss, logps_BC)
    per_token_BC, slope_BC = hand_per_token(trainer, loss_type, inputs["advantages"], logps_BC)
    w_BC = token_weights_BC(
        loss_type,
        inputs["completion_mask"],
        accumulation=trainer.args.gradient_accumulation_steps,
        max_completion_length=trainer.args.max_completion_length,
        num_items_in_batch=inputs["num_items_in_batch"],
        num_processes=1,
        steps_per_generation=trainer.args.steps_per_generation,
    )
    return loss, grad_BC, per_token_BC, slope_BC, w_BC, inputs["completion_mask"]


@pytest.mark.parametrize("case", CASES)
@pytest.mark.parametrize("loss_type", sorted(SCALING))
def test_token_weights_match_trl_compute_loss(loss_type, case, tok, tmp_path):
    trainer = plain_trainer(tok, tmp_path, loss_type, case)
    loss, grad_BC, per_token_BC, slope_BC, w_BC, mask_BC = scored(trainer, loss_type, case)
    torch.testing.assert_close(loss.double(), (per_token_BC * w_BC).sum(), **CLOSE)
    torch.testing.assert_close(grad_BC, slope_BC * w_BC, **CLOSE)
    assert bool((w_BC[mask_BC == 0] == 0).all()) and bool((grad_BC[mask_BC == 0] == 0).all())
    assert bool((grad_BC[mask_BC == 1] != 0).all())  # every advantage is non-zero: every token counts


@pytest.mark.parametrize("case", ["accumulated", "split-generation"])
def test_luspo_at_the_sequence_level_it_is_meant_for(case, tok, tmp_path):
    """luspo's recommended setup: one ratio per sequence, (B, 1) losses broadcast onto the mask before the sum."""
    trainer = plain_trainer(tok, tmp_path, "luspo", case, importance_sampling_level="sequence")
    loss, grad_BC, per_token_BC, slope_BC, w_BC, _ = scored(trainer, "luspo", case)
    torch.testing.assert_close(loss.double(), (per_token_BC * w_BC).sum(), **CLOSE)
    # the sequence ratio is the masked mean of the token log-ratios: the row's weight sum spread over its tokens,
    # which is w_BC itself since luspo's weights are constant along a row
    torch.testing.assert_close(grad_BC, slope_BC * w_BC, **CLOSE)


def test_the_weights_differ_between_kinds_on_this_batch():
    """The cases above separate the kinds: no two aggregations give the same weights on the scored micro-batch."""
    inputs = generation_batch("split-generation")
    _, A, S, _, max_len, _, _ = CASES["split-generation"]
    kinds = {}
    for loss_type, kind in SCALING.items():
        kinds[kind] = token_weights_BC(
            loss_type,
            inputs["completion_mask"],
            accumulation=A,
            max_completion_length=max_len,
            num_items_in_batch=inputs["num_items_in_batch"],
            steps_per_generation=S,
        )
    values = list(kinds.values())
    assert all(not torch.allclose(a, b) for i, a in enumerate(values) for b in values[i + 1 :])


def test_trl_documents_exactly_the_scaled_loss_types():
    """A TRL release that adds (or drops) a loss_type fails here until SCALING says how it aggregates."""
    help_text = trl.GRPOConfig.__dataclass_fields__["loss_type"].metadata["help"]
    assert documented_loss_types(help_text) == set(SCALING)


def test_documented_loss_types_reads_the_quoted_names_of_the_supported_values_sentence():
    text = "Pick one. Supported values are 'alpha', 'beta_two', and 'gamma'. 'alpha': the 'delta' variant."
    assert documented_loss_types(text) == {"alpha", "beta_two", "gamma"}
    assert documented_loss_types("No list here: 'alpha' and 'beta'. More text.") == set()
