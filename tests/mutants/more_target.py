"""Mutants of the routing target (issue 74): its controller, its state through a resume, and what it measures;
joined into ``tests.mutants.catalogue.MUTANTS``."""

from __future__ import annotations

from tests.mutants.harness import Mutant

TARGET = "tests/anchors/test_target.py"
HOLD = "tests/train/test_hold.py"
RANKS = "tests/train/test_run_distributed.py"
SFT = "tests/integrations/trl/test_sft.py"
GRPO = "tests/integrations/trl/test_base_routing.py"

MUTANTS: tuple[Mutant, ...] = (
    Mutant(
        name="target_controller_sign_flipped",
        story="the controller lowers lambda when the routing falls below the target and raises it above",
        path="anchors/target.py",
        function="TargetController.error",
        pattern=r"\(s\.target - m\) / allowed",
        replacement="(m - s.target) / allowed",
        tests=(f"{TARGET}::test_a_known_measure_sequence_gives_the_documented_lambdas",),
    ),
    Mutant(
        name="target_lambda_not_restored_on_resume",
        story="a resumed target run reads the controller's state back but keeps stepping from lambda_0",
        path="train/hold.py",
        function="RoutingHold.load",
        pattern=r"self\.anchor\.lambda_now = self\.controller\.lam",
        replacement="self.controller.lam = self.controller.settings.lambda_0; self.anchor.lambda_now = 1.0",
        tests=(f"{HOLD}::test_a_target_raises_lambda_after_the_routing_falls_below_it_and_resumes_as_it_ran",),
    ),
    Mutant(
        name="overlap_against_the_models_own_routing",
        story="the overlap compares the model's top-k with itself, not with the base's: it reads 1 whatever the drift",
        path="anchors/overlap.py",
        function="OverlapCounts.count",
        pattern=r"self\.add\(pos, \*shared_share\(model_ids_TK, base_ids_TK, counted_T\)\)",
        replacement="self.add(pos, *shared_share(model_ids_TK, model_ids_TK, counted_T))",
        tests=(f"{HOLD}::test_the_logged_overlap_is_the_hand_count_of_each_steps_sets",),
    ),
    Mutant(
        name="overlap_counts_padding",
        story="the overlap counts padding tokens too, which the routing-kd term never weighs",
        path="anchors/overlap.py",
        function="OverlapCounts.count",
        pattern=r"counted_T = weight_T > 0",
        replacement="counted_T = weight_T >= 0",
        tests=(f"{HOLD}::test_the_logged_overlap_is_the_hand_count_of_each_steps_sets",),
    ),
    Mutant(
        name="overlap_not_summed_over_ranks",
        story="each rank steers lambda from its own rows' overlap: the ranks' lambdas drift apart, and none is the "
        "whole batch's",
        path="train/hold.py",
        function="RoutingHold.on_step_end",
        pattern=r"            dist\.all_reduce\(flat\)\n",
        replacement="",
        tests=(f"{RANKS}::test_a_routing_target_steps_the_same_lambda_on_two_processes_as_on_one",),
    ),
    Mutant(
        name="overlap_keeps_only_the_last_micro_batch",
        story="each micro-batch's counts replace the step's so far: with accumulation the step's overlap is its last "
        "micro-batch's",
        path="anchors/overlap.py",
        function="OverlapCounts.add",
        pattern=r"self\.shared_L\[pos\] \+= shared\n        self\.tokens_L\[pos\] \+= tokens",
        replacement="self.shared_L[pos] = shared\n        self.tokens_L[pos] = tokens",
        tests=(f"{HOLD}::test_the_logged_overlap_is_the_hand_count_of_each_steps_sets[2-online]",),
    ),
    Mutant(
        name="monitor_not_on_where_the_base_is_at_hand",
        story="the monitor stays off unless asked, even under routing-kd: rpb train's log shows no routing drift",
        path="monitor/callback.py",
        function="attach_default_monitor",
        pattern=r'if anchor is None or getattr\(anchor, "overlap", None\) is None:',
        replacement="if True:",
        tests=(f"{HOLD}::test_the_logged_overlap_is_the_hand_count_of_each_steps_sets[1-online]",),
    ),
    Mutant(
        name="hold_not_rebound_after_reinstall",
        story="TRL wraps the model with PEFT and the anchor moves onto it, while the overlap is still read from the "
        "removed anchor: no anchor/overlap is logged, and a target steers from nothing",
        path="train/hold.py",
        function="HoldingTrainer.rebind_anchor",
        pattern=r"self\.rpb_hold\.rebind\(anchor\)",
        replacement="pass",
        tests=(f"{SFT}::test_routing_kd_under_trls_peft_config_takes_the_model_with_its_adapters_off_as_the_base",),
    ),
    Mutant(
        name="grpo_target_not_stepped",
        story="rpb's GRPOTrainer accepts a routing target and trains at lambda_0 throughout, never stepping it",
        path="integrations/trl/grpo.py",
        function="GRPOTrainer.__init__",
        pattern=r"        self\.hold_routing\(monitor\)\n",
        replacement="        self.hold_routing(monitor)\n        self.rpb_hold.controller = None\n",
        tests=(f"{GRPO}::test_a_routing_target_in_grpo_steps_lambda_at_every_update_of_a_generation_batch",),
    ),
)
