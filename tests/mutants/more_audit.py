"""Mutants of the audit: what it infers was asked, and what it leaves as found
(issue 48); joined into ``tests.mutants.catalogue.MUTANTS``."""

from __future__ import annotations

from tests.mutants.harness import Mutant

AUDIT = "tests/monitor/test_audit.py"
ASKED = "tests/monitor/test_asked.py"

MUTANTS: tuple[Mutant, ...] = (
    Mutant(
        name="audit_calls_the_router_alone",
        story="rpb audit calls each router with the hidden states alone: MiniMax-M2's, which takes its block's "
        "expert-correction bias too, raises a TypeError",
        path="monitor/audit.py",
        function="_effective_logits",
        pattern=r"call_router\(layer, facts, hidden_TH, module\)",
        replacement="module(hidden_TH)",
        tests=(f"{AUDIT}::test_rpb_audit_runs_minimax_m2_whose_router_takes_the_blocks_bias",),
    ),
    Mutant(
        name="audit_reruns_on_moved_routers",
        story="rpb audit's four step-2 reruns put the buffers back but not the routers' weights: a hook moving a "
        "frozen sigmoid router at each forward reads as a native load-balancing loss",
        path="monitor/audit.py",
        function="audit",
        pattern=r"kept \+= \[\(p, p\.detach\(\)\.clone\(\)\) for m in layers",
        replacement="kept += [] and [(p, p.detach().clone()) for m in layers",
        tests=(f"{AUDIT}::test_a_hook_moving_a_frozen_routers_weight_is_caught_and_nothing_else",),
    ),
    Mutant(
        name="audit_only_experts_router_free",
        story="rpb audit reads train.only_experts as leaving the router free: a correct sft + only_experts "
        "configuration is reported as a contradiction (no gradient reached the router), exit 3",
        path="monitor/asked.py",
        function="asked_from_config",
        pattern=r"frozen = frozen or not read_choice\(cfg\.train\.only_experts\)\.non_expert_modules",
        replacement="frozen = frozen",
        tests=(
            f"{AUDIT}::test_rpb_audit_passes_sft_training_only_chosen_experts",
            f"{ASKED}::test_only_experts_freezes_the_router_unless_the_choice_trains_non_expert_modules[False]",
        ),
    ),
    Mutant(
        name="audit_ignores_the_lora_record",
        story="rpb audit reads only requires_grad: a router frozen by hand before rpb's LoRA wrap, then trained "
        "as PEFT's copy, passes as free",
        path="monitor/asked.py",
        function="frozen_routers",
        pattern=r"elif record is not None and m\.layer_index in record:",
        replacement="elif False:",
        tests=(f"{AUDIT}::test_a_router_frozen_by_hand_before_rpbs_lora_then_trained_as_a_copy_is_caught",),
    ),
    Mutant(
        name="lora_records_after_the_wrap",
        story="apply_lora reads which routers were frozen after PEFT froze every base weight: every router "
        "counts as frozen by hand",
        path="train/lora.py",
        function="apply_lora",
        pattern=r"setattr\(wrapped, asked.FROZEN_ROUTERS, frozen\)",
        replacement="setattr(wrapped, asked.FROZEN_ROUTERS, tuple(m.layer_index for m in find_moe_layers(model, facts) "
        "if not m.trainable))",
        tests=(f"{AUDIT}::test_a_router_frozen_by_hand_before_rpbs_lora_then_trained_as_a_copy_is_caught",),
    ),
    Mutant(
        name="audit_silent_on_a_user_wrap",
        story="rpb audit counts a router the user's PEFT wrap made trainable as free without a word, though it "
        "cannot tell whether it was frozen on purpose",
        path="monitor/asked.py",
        function="frozen_routers",
        pattern=r"if record is None and wrapped:",
        replacement="if False:",
        tests=(f"{ASKED}::test_a_router_the_user_wrapped_counts_free_with_one_warning_naming_the_asked_field",),
    ),
    Mutant(
        name="audit_native_aux_unread",
        story="rpb audit asks nothing about the native load-balancing loss on a plain trainer: a loss the model's "
        "config turns off, added by the trainer, passes",
        path="monitor/asked.py",
        function="asked_from_model",
        pattern=r"native_aux=native_aux_of\(model\)",
        replacement="native_aux=None",
        tests=(f"{AUDIT}::test_a_native_aux_loss_the_models_config_turns_off_is_caught_without_being_told",),
    ),
    Mutant(
        name="audit_frozen_all_or_nothing",
        story="rpb audit holds routers frozen only when every one is: one router frozen by hand, moved, passes",
        path="monitor/verdict.py",
        function="contradictions",
        pattern=r"frozen = \[a for a in rows if asked\.frozen_at\(a\.layer\)\]",
        replacement='frozen = [a for a in rows if asked.router == "frozen"]',
        tests=(f"{AUDIT}::test_a_router_frozen_by_hand_before_rpbs_lora_then_trained_as_a_copy_is_caught",),
    ),
)
