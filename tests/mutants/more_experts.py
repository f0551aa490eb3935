"""Mutants of training only the chosen experts: masks, biases, shared experts, devices, optimizers, the zero-share
warning (issue 48); joined into ``tests.mutants.catalogue.MUTANTS``."""

from __future__ import annotations

from tests.mutants.harness import Mutant

MASKS = "tests/experts/test_masks.py::"

MUTANTS: tuple[Mutant, ...] = (
    Mutant(
        name="expert_mask_pinned_to_its_install_device",
        story="an expert mask keeps the device it was made on: rpb train installs it on the CPU, the Trainer "
        "moves the model to the GPU, and the first backward multiplies a CUDA gradient by a CPU mask",
        path="experts/masks.py",
        function="GradMask.__call__",
        pattern=r"self\.mask\.to\(device=grad\.device, dtype=grad\.dtype\)",
        replacement="self.mask.to(dtype=grad.dtype)",
        tests=(MASKS + "test_masks_follow_their_parameters_to_the_meta_device_and_back",),
    ),
    Mutant(
        name="expert_mask_pinned_to_its_install_dtype",
        story="a LoRA expert mask keeps the float32 it was made in: after a cast to bfloat16 the hook hands "
        "back a float32 gradient and the backward fails",
        path="experts/masks.py",
        function="GradMask.__call__",
        pattern=r"self\.mask\.to\(device=grad\.device, dtype=grad\.dtype\)",
        replacement="self.mask.to(device=grad.device)",
        tests=(MASKS + "test_masks_follow_a_dtype_cast_after_they_are_installed[lora]",),
    ),
    Mutant(
        name="expert_mask_lost_when_the_parameter_is_replaced",
        story="the mask's hook sits on the parameter object alone: a move that replaces the parameters "
        "(the meta device, swapped tensors) drops it and the unchosen experts train",
        path="experts/masks.py",
        function="GradMask.__init__",
        pattern=r"owner\.register_forward_pre_hook\(lambda module, args: self\.install\(\)\)",
        replacement="pass",
        tests=(MASKS + "test_masks_follow_their_parameters_to_the_meta_device_and_back",),
    ),
    Mutant(
        name="expert_decay_list_shared_by_every_optimizer",
        story="the expert mask keeps one decay list for every optimizer it fitted: the audit's optimizer, "
        "thrown away, leaves its entries, and training after the audit decays the chosen experts twice",
        path="experts/masks.py",
        function="ExpertMask.restrict_decay",
        pattern=r"decayed = \[\]",
        replacement='decayed = self.__dict__.setdefault("_all_decayed", [])',
        tests=(MASKS + "test_an_audit_leaves_the_expert_mask_as_it_found_it",),
    ),
    Mutant(
        name="expert_biases_follow_non_expert_modules",
        story="only the routed experts' weights are split by expert: gpt-oss's per-expert biases follow "
        "non_expert_modules (all experts' biases train, or none)",
        path="experts/masks.py",
        function="routed_expert_parameter",
        pattern=r"\\\.\(\.\+\)\$",
        replacement=r"\\.((?:gate_up|down)_proj)$",
        tests=(
            MASKS + "test_gpt_oss_per_expert_biases_follow_the_expert_mask[False]",
            MASKS + "test_gpt_oss_per_expert_biases_follow_the_expert_mask[True]",
        ),
    ),
    Mutant(
        name="shared_expert_gate_follows_non_expert_modules",
        story="Qwen2-MoE's shared_expert_gate is not counted with the shared experts: it trains with the "
        "non-expert modules instead",
        path="experts/masks.py",
        function="train_only_experts",
        pattern=r"SHARED\.search\(f\"\.\{name\}\"\)",
        replacement='re.search(r"\\.shared_experts?\\.", f".{name}")',
        tests=(
            MASKS + "test_qwen2_moe_shared_expert_gate_follows_shared_experts[True-False]",
            MASKS + "test_qwen2_moe_shared_expert_gate_follows_shared_experts[False-True]",
        ),
    ),
    Mutant(
        name="zero_share_check_reads_the_gate_scores",
        story="rpb experts checks the chosen experts against the measure's own scores: the gate measure's "
        "probabilities are never 0, so experts the router never selects pass unnamed",
        path="experts/run.py",
        function="run_experts",
        pattern=r"never_selected\(chosen, shares_LE,",
        replacement="never_selected(chosen, scores_LE,",
        tests=("tests/experts/test_run.py::test_a_chosen_expert_the_router_never_selects_is_named",),
    ),
)
