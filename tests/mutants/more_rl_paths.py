"""Mutants of issue 61: GRPO as people run it (rpb.replay.record's placement by offset, the generation batch's
state, the training-only replay and bias, the precision settings); joined into ``tests.mutants.catalogue.MUTANTS``."""

from __future__ import annotations

from tests.mutants.harness import Mutant

RECORD = "tests/replay/test_record.py"
PATHS = "tests/integrations/trl/test_generation_paths.py"
RL_PRIOR = "tests/integrations/trl/test_rl_prior.py"
GRPO = "tests/integrations/trl/test_grpo.py"
ROLLOUTS = "tests/integrations/trl/test_rollouts.py"
AUDIT = "tests/monitor/test_audit.py"

MUTANTS: tuple[Mutant, ...] = (
    Mutant(
        name="routes_placed_by_counting_forwards",
        story="each forward's routes are appended after the last ones, as if every forward added its positions: "
        "without a KV cache every step forwards the whole sequence again and every route lands elsewhere",
        path="replay/record.py",
        function="GenerationRecorder._on_inputs",
        pattern=r"offset = forward_offset\(ids_Bs, kwargs\)",
        replacement="offset = self._filled",
        tests=(
            f"{RECORD}::test_routes_are_the_full_forwards_at_every_real_position[qwen3_moe-greedy-no-cache]",
            f"{PATHS}::test_the_routes_are_each_tokens_own_on_every_generation_path[moonlight-no-cache]",
        ),
    ),
    Mutant(
        name="a_position_forwarded_again_takes_the_later_route",
        story="a position forwarded twice keeps its last forward's route, not its first: chunked prefill and "
        "no-cache generation are right by luck, a tool turn's prompt re-forwarded with other padding is not",
        path="replay/record.py",
        function="GenerationRecorder._on_inputs",
        pattern=r"start, new = max\(offset, self\._filled\), ",
        replacement="start, new = max(offset, self._filled) * 0 + offset, ",
        tests=(f"{RECORD}::test_routes_are_the_full_forwards_at_every_real_position[qwen3_moe-greedy-no-cache]",),
    ),
    Mutant(
        name="turn_routes_read_one_position_late",
        story="a generate call's routes are read off its padded layout one position late: every token replays "
        "its successor's experts (a wrong rollout is refused by its tokens; a wrong offset is not)",
        path="integrations/trl/generation.py",
        function="GenerationState.add_turn",
        pattern=r"routes_BSLK\[j, start \+ record\.routed : start \+ len\(tokens\) - 1\]",
        replacement="routes_BSLK[j, start + record.routed + 1 : start + len(tokens)]",
        tests=(f"{PATHS}::test_the_routes_are_each_tokens_own_on_every_generation_path[qwen3_moe-tools]",),
    ),
    Mutant(
        name="rpb_labels_only_on_the_recorded_path",
        story="RPB's token labels are built only where rpb records generation: a rollout_func, use_vllm or "
        "continuous batching trains plain GRPO under the name rpb",
        path="integrations/trl/rollouts.py",
        function="RolloutRoutes._generate",
        pattern=r"if self\.anchor\.prior is not None:  # from the tokens",
        replacement="if self.anchor.prior is not None and state.rollouts:  # from the tokens",
        tests=(f"{RL_PRIOR}::test_the_training_forward_reads_each_tokens_row_and_span[rollout_func]",),
    ),
    Mutant(
        name="evaluation_scored_as_training",
        story="evaluate()'s old-log-prob forward goes through the training path: it is replayed and biased, and "
        "eval's clip figures compare a replayed forward with a free one",
        path="integrations/trl/grpo.py",
        function="GRPOTrainer._generate_and_score_completions",
        pattern=r"if not self\.model\.training:  # evaluation",
        replacement="if False:  # evaluation",
        tests=(f"{RL_PRIOR}::test_scoring_and_evaluation_stay_out_of_the_monitor_and_the_bias",),
    ),
    Mutant(
        name="scoring_forward_observed",
        story="the old-log-prob forward runs inside the anchor's step and its taps: the monitor counts every "
        "completion token twice under rpb",
        path="integrations/trl/grpo.py",
        function="GRPOTrainer._first_forward",
        pattern=r", self\.anchor\.unobserved\(\):",
        replacement=":",
        tests=(f"{RL_PRIOR}::test_scoring_and_evaluation_stay_out_of_the_monitor_and_the_bias",),
    ),
    Mutant(
        name="scoring_in_one_forward_under_rpb",
        story="the anchor's context covers the whole generation batch, so it is scored in one forward: activation "
        "memory grows with steps_per_generation",
        path="integrations/trl/grpo.py",
        function="GRPOTrainer._first_forward",
        pattern=r"biased = self\._prior_rows\(\*batch_labels\(state\.labels, P, logits_to_keep\), attention_mask\)",
        replacement="kw['batch_size'] = input_ids.shape[0]\n            "
        "biased = self._prior_rows(*batch_labels(state.labels, P, logits_to_keep), attention_mask)",
        tests=(f"{RL_PRIOR}::test_scoring_and_evaluation_stay_out_of_the_monitor_and_the_bias",),
    ),
    Mutant(
        name="missing_rollout_logp_read_as_zero",
        story="a rollout log-probability the engine did not report counts as 0 in the gap: the figure reports "
        "the missing values, not the mismatch",
        path="integrations/trl/rollouts.py",
        function="RolloutRoutes._log_mismatch",
        pattern=r"mask_BC \* seen_BC\)",
        replacement="mask_BC)",
        tests=(f"{ROLLOUTS}::test_missing_rollout_logps_are_counted_never_a_crash[all]",),
    ),
    Mutant(
        name="rollout_dtype_under_bf16_accepted",
        story="rollout_dtype is accepted beside TRL's bf16=True default: both sides run under bfloat16 autocast, "
        "and the precision gap the user asked for is silently absent",
        path="integrations/trl/grpo.py",
        function="config_problems",
        pattern=r"elif rollout_dtype is not None and \(args\.bf16 or args\.fp16\):",
        replacement="elif False:",
        tests=(f"{GRPO}::test_rollout_dtype_under_trls_bf16_default_is_refused_in_the_config",),
    ),
    Mutant(
        name="audit_reach_read_at_the_runs_own_coefficient",
        story="whether the anchor's term reaches the gradient is read at the run's own coefficient: one small step "
        "from the base, a working kl-to-base at lambda 0.1 is a millionth of the LM gradient and called detached",
        path="monitor/audit.py",
        function="_report",
        pattern=r"reaches = significant\(p_scaled - p_no_anchor, p_full\)",
        replacement="reaches = significant(p_full - p_no_anchor, p_full)",
        tests=(f"{AUDIT}::test_a_working_kl_to_base_at_the_docs_lambda_is_no_contradiction_in_sft[moonlight-1.0e-6]",),
    ),
    Mutant(
        name="policy_read_by_identity_under_ddp",
        story="the trainer's own forward is recognised by object identity: under DDP the loss sees the wrapped "
        "model, and the log-probability gap figures vanish on more than one process",
        path="integrations/trl/grpo.py",
        function="GRPOTrainer._is_policy",
        pattern=r"return model is self\.model or self\.accelerator\.unwrap_model\(model\) is self\.model",
        replacement="return model is self.model",
        tests=(
            "tests/integrations/trl/test_grpo_distributed.py::"
            "test_two_processes_replay_their_own_rows_and_log_what_one_process_logs",
        ),
    ),
)
