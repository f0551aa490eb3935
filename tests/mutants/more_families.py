"""Mutants of the family matrix: bugs that sit where a family differs from Qwen3-MoE, each caught by
tests/project/test_family_matrix.py on the family it concerns (issue 48); joined into
``tests.mutants.catalogue.MUTANTS``."""

from __future__ import annotations

from tests.mutants.harness import Mutant

MATRIX = "tests/project/test_family_matrix.py"

MUTANTS: tuple[Mutant, ...] = (
    Mutant(
        name="matrix_monitor_softmax_on_sigmoid_families",
        story="the monitor reads every family's KL as softmax: on DeepSeek-V3 and GLM-4.5 it shows another "
        "quantity than the normalised sigmoid their routers score with",
        path="monitor/routing.py",
        function="RoutingMonitor._transform",
        pattern=r"return own or anchor or family_transform\(self\.facts\.score_function\)",
        replacement='return own or anchor or "softmax"',
        tests=(
            f"{MATRIX}::test_the_monitor_reads_moved_routers_as_a_hand_computation[deepseek_v3]",
            f"{MATRIX}::test_the_monitor_reads_moved_routers_as_a_hand_computation[glm4_5_air]",
        ),
    ),
    Mutant(
        name="matrix_monitor_base_without_the_router_bias",
        story="the monitor's frozen base router drops the router's own bias: on gpt-oss the base's logits and "
        "choices are not the base's",
        path="monitor/routing.py",
        function="RoutingMonitor._frozen",
        pattern=r"bias = getattr\(router, self\.facts\.router_bias\) if self\.facts\.router_bias else None",
        replacement="bias = None",
        tests=(f"{MATRIX}::test_the_monitor_reads_moved_routers_as_a_hand_computation[gpt_oss_20b]",),
    ),
    Mutant(
        name="matrix_expert_biases_escape_the_mask",
        story="only the fused expert weights follow the expert mask: gpt-oss's per-expert biases follow "
        "non_expert_modules instead",
        path="experts/masks.py",
        function="routed_expert_parameter",
        pattern=r"\\\.\(\.\+\)\$",
        replacement=r"\\.((?:gate_up|down)_proj)$",
        tests=(f"{MATRIX}::test_expert_training_moves_the_chosen_experts_alone[gpt_oss_20b]",),
    ),
)
