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
DRY = "tests/train/test_dryrun.py"

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
        path="integrations/trl/grpo_checks.py",
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
    Mutant(
        name="recording_copied_to_the_host_at_every_router_call",
        story="every router call's ids are copied to the host as they are recorded: a blocking transfer per layer "
        "and step of generation on a GPU, replay off included",
        path="replay/record.py",
        function="GenerationRecorder._on_router",
        pattern=r"\[:, start - offset :\]\.to\(dtype\)",
        replacement="[:, start - offset :].to(dtype).cpu()",
        tests=(f"{RECORD}::test_recording_stays_on_the_device_until_it_is_read",),
    ),
    Mutant(
        name="reference_answer_dropped",
        story="prepare_grpo keeps only its own columns: the reward function never receives the row's reference answer",
        path="integrations/trl/rl_prior.py",
        function="prepare_grpo",
        pattern=r"                REFERENCE_COLUMN: reference,\n",
        replacement="",
        tests=(f"{RL_PRIOR}::test_the_reward_receives_each_rows_reference_answer_and_own_fields",),
    ),
    Mutant(
        name="anchor_term_not_logged_in_grpo",
        story="the anchor's term goes into GRPO's loss but never into its logs: a user cannot see what it adds",
        path="integrations/trl/grpo.py",
        function="GRPOTrainer._compute_loss",
        pattern=r"\[f\"anchor/\{self\.anchor\.method\.name\}\"\]\.append",
        replacement='["anchor"].append',
        tests=(f"{GRPO}::test_every_anchor_with_every_replay_mode_trains_three_steps[kl-to-base-off]",),
    ),
    Mutant(
        name="anchor_on_another_model_accepted",
        story="an anchor installed on another model object than the trainer's is taken as it is: its hooks sit on "
        "routers that never run",
        path="integrations/trl/grpo_checks.py",
        function="trainer_problems",
        pattern=r"if anchor is not None and anchor\.model is not model:",
        replacement="if False:",
        tests=(f"{GRPO}::test_an_anchor_installed_on_another_model_object_is_refused",),
    ),
    Mutant(
        name="r2_equal_to_off_unsaid",
        story="R2 in a configuration where no batch is trained after the policy moved runs without a word: the user "
        "pays a forward for nothing",
        path="integrations/trl/grpo.py",
        function="GRPOTrainer.__init__",
        pattern=r"if self\.replay_mode in \(\"R2\", \"PR2\"\) and trained_unmoved:",
        replacement="if False:",
        tests=(f"{GRPO}::test_r2_that_equals_off_says_so",),
    ),
    Mutant(
        name="forced_r2_forward_text_only",
        story="R2's forced first forward is handed the tokens alone: a vision-language model's routes and old log-"
        "probabilities come from a text-only forward",
        path="integrations/trl/grpo.py",
        function="GRPOTrainer._generate_and_score_completions",
        pattern=r"                        \*\*fields,\n",
        replacement="",
        tests=(f"{GRPO}::test_the_forced_r2_forward_gets_every_field_trls_forward_takes",),
    ),
    Mutant(
        name="missing_local_folder_read_as_a_repo_id",
        story="a local model folder that does not exist goes to the hub client, which answers about the repo-id form",
        path="models.py",
        function="_loading",
        pattern=r"if name and local_path_missing\(name\):",
        replacement="if False:",
        tests=(
            "tests/test_models.py::test_a_local_folder_that_does_not_exist_is_said_so_not_a_repo_id_form[runs/base/final]",
        ),
    ),
    Mutant(
        name="revert_data_files_checked_after_loading",
        story="the revert's data files are read one by one after the tokenizer and models load: a missing one is a "
        "traceback, the others unnamed",
        path="retention/revert_run.py",
        function="run_revert",
        pattern=r"    if missing:  # every one at once",
        replacement="    if False:  # every one at once",
        tests=("tests/cli/test_retention.py::test_every_missing_domain_file_is_named_before_any_model_loads",),
    ),
    Mutant(
        name="dry_run_leaves_the_fingerprint_unchecked",
        story="--dry-run passes a prior made for another model although the checkpoint's router tensors are on disk",
        path="train/dryrun.py",
        function="dry_run",
        pattern=r"report\.model_checked = _model_fields\(cfg, meta, problems\)",
        replacement="report.model_checked = False",
        tests=(f"{DRY}::test_a_dry_run_refuses_a_prior_made_for_another_model",),
    ),
    Mutant(
        name="monitor_kl_below_zero_logged",
        story="the monitor's KL, summed in floating point, is logged a hair below zero",
        path="monitor/routing.py",
        function="layer_figures",
        pattern=r"\(kl_L / tokens_L\)\.clamp\(min=0\.0\)",
        replacement="(kl_L / tokens_L)",
        tests=("tests/monitor/test_routing.py::test_a_kl_below_zero_by_rounding_is_zero",),
    ),
    Mutant(
        name="small_delta_printed_as_minus_zero",
        story="a difference of 1e-5 prints as -0.0000 [-0.0000, +0.0000]",
        path="retention/revert_report.py",
        function="signed",
        pattern=r"abs\(x\) >= 5e-5",
        replacement="True",
        tests=(
            "tests/retention/test_revert_report.py::test_small_differences_print_in_scientific_notation_never_as_minus_zero",
        ),
    ),
)
