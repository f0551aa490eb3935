"""Mutants of issue 50: routing replay (rpb.replay) and GRPO in TRL with the anchors (rpb.integrations.trl.grpo,
scaling); joined into ``tests.mutants.catalogue.MUTANTS``."""

from __future__ import annotations

from tests.mutants.harness import Mutant

REPLAY = "tests/replay/test_replay.py"
RL_PRIOR = "tests/integrations/trl/test_rl_prior.py"
GRPO = "tests/integrations/trl/test_grpo.py"

MUTANTS: tuple[Mutant, ...] = (
    Mutant(
        name="replayed_gates_detached",
        story="the replayed gates are computed from detached logits: the experts are right, but the router gets "
        "no gradient from the loss while replay is on",
        path="replay/replay.py",
        function="RouteReplay._hook",
        pattern=r"combine_weights\(logits_TE, new_ids_TK",
        replacement="combine_weights(logits_TE.detach(), new_ids_TK",
        tests=(f"{REPLAY}::test_the_router_gradient_runs_through_the_replayed_gates[qwen3_30b_a3b]",),
    ),
    Mutant(
        name="replay_left_to_the_router",
        story="the replay hook records but hands the router's own output on: R3 silently trains on the training "
        "forward's routing, the mismatch it was meant to remove",
        path="replay/replay.py",
        function="RouteReplay._hook",
        pattern=r"return logits_TE, torch\.where\(has_T1, new_gates_TK, gates_TK\), new_ids_TK",
        replacement="return None",
        tests=(f"{REPLAY}::test_r3_replays_the_bf16_rollout_routes_in_a_fp32_forward[deepseek_v3]",),
    ),
    Mutant(
        name="recorded_positions_shifted_by_the_left_padding",
        story="the rollout's tokens are taken as right-padded in generation's left-padded layout: every "
        "shorter prompt's routes land on other positions",
        path="integrations/trl/generation.py",
        function="GenerationState.add_turn",
        pattern=r"start = P - len\(p\)",
        replacement="start = 0",
        tests=(
            "tests/integrations/trl/test_rollouts.py::test_each_rollouts_routes_travel_with_it_through_trls_shuffle",
        ),
    ),
    Mutant(
        name="routes_not_moved_with_their_rollouts",
        story="the batch's routes are put in another row order than its rollouts (as routes shuffled apart from "
        "the batch, or kept beside it while TRL shuffles the batch, end up): each row replays another rollout's "
        "experts",
        path="integrations/trl/grpo.py",
        function="GRPOTrainer._attach",
        pattern=r"output\[\"rpb_rollout_routes\"\] = routes\.to\(",
        replacement='output["rpb_rollout_routes"] = routes.roll(1, dims=0).to(',
        tests=(
            "tests/integrations/trl/test_rollouts.py::test_each_rollouts_routes_travel_with_it_through_trls_shuffle",
        ),
    ),
    Mutant(
        name="generation_logps_read_without_the_temperature",
        story="the rollout's log-probabilities are read from the raw logits without TRL's temperature: the "
        "log-probability gap reports the temperature, not the engine",
        path="replay/record.py",
        function="GenerationRecorder._on_outputs",
        pattern=r"\.float\(\) / self\.temperature",
        replacement=".float()",
        tests=(
            "tests/replay/test_record.py::test_logps_are_the_raw_logits_over_the_temperature[qwen3_moe-sampled-cache]",
        ),
    ),
    Mutant(
        name="trl_aux_coefficient_left_at_the_model_configs",
        story="TRL's router_aux_loss_coef is left unset: TRL 1.16 then reads the model config's coefficient and "
        "adds a hidden load-balancing loss to every GRPO run",
        path="integrations/trl/grpo.py",
        function="GRPOTrainer.__init__",
        pattern=r"        hold_native_aux_off\(args\)\n",
        replacement="        args.router_aux_loss_coef = None\n",
        tests=(f"{GRPO}::test_every_anchor_with_every_replay_mode_trains_three_steps[sft-off]",),
    ),
    Mutant(
        name="flip_rate_counted_over_prompt_tokens",
        story="the flip rate counts the prompt's tokens beside the completion's: the figure mixes in tokens the "
        "policy loss never reads",
        path="replay/mismatch.py",
        function="completion_positions",
        pattern=r"prompt_BP = completion_mask_BC\.new_zeros",
        replacement="prompt_BP = completion_mask_BC.new_ones",
        tests=(f"{REPLAY}::test_off_counts_the_precision_gap_as_a_hand_count[qwen3_30b_a3b]",),
    ),
    Mutant(
        name="global_token_loss_types_not_rescaled",
        story="dapo's, cispo's and vespo's anchors divide by the generation batch's tokens without TRL's rescaling "
        "to one accumulation window: under accumulation a coefficient means another share of the loss",
        path="integrations/trl/scaling.py",
        function="token_weights_BC",
        pattern=r"mask_BC / \(items \* accumulation / steps_per_generation\)",
        replacement="mask_BC / items",
        tests=("tests/integrations/trl/test_scaling.py::test_token_weights_match_trl_compute_loss[dapo-accumulated]",),
    ),
    Mutant(
        name="grpo_token_weights_ignored",
        story="the anchor averages its term over every attended token alike, prompts included, whatever GRPO's "
        "loss_type weighs",
        path="anchors/handle.py",
        function="AnchorHandle._hook",
        pattern=r"weight_T = valid_T if ctx\.weight_T is None else ctx\.weight_T\.to\(logits_TE\.device\)",
        replacement="weight_T = valid_T",
        tests=(f"{GRPO}::test_the_anchor_term_in_the_router_gradient_is_its_formula[kl-to-base-grpo]",),
    ),
    Mutant(
        name="r2_old_log_prob_forward_not_forced",
        story="under R2 the old-log-prob forward is left to TRL, which skips it when accumulation fills the "
        "generation cycle: the batch has no first routing to replay from its start",
        path="integrations/trl/grpo.py",
        function="GRPOTrainer._generate_and_score_completions",
        pattern=r"if self\.replay_mode in \(\"R2\", \"PR2\"\) and state\.first_routes is None",
        replacement="if False",
        tests=(f"{GRPO}::test_r2_forces_the_old_log_prob_forward_where_trl_would_skip_it",),
    ),
    Mutant(
        name="completion_reads_the_q_prior",
        story="a rollout's completion tokens are labelled as the question's span: RPB pulls the answer's routing "
        "toward the prompt's, which the Q / A split of the prior exists to avoid",
        path="integrations/trl/rl_prior.py",
        function="rollout_labels",
        pattern=r"completion = \[A_SPAN if keep",
        replacement="completion = [0 if keep",
        tests=(f"{RL_PRIOR}::test_the_training_forward_reads_each_tokens_row_and_span",),
    ),
    Mutant(
        name="old_log_prob_forward_unbiased_under_rpb",
        story="the old-log-prob forward runs without the bias: R2 records and replays the bias-free routing, and "
        "the importance ratio compares a biased forward with an unbiased one",
        path="integrations/trl/grpo.py",
        function="GRPOTrainer._first_forward",
        pattern=r"biased = self\._prior_rows\(",
        replacement="_ = self._prior_rows(",
        tests=(f"{RL_PRIOR}::test_r2_replays_the_biased_first_forward",),
    ),
    Mutant(
        name="prompt_rendered_otherwise_accepted",
        story="TRL's prompt tokens are not checked against rpb's labelling: a prompt rendered with another "
        "template gives its tokens another row's or span's bias, silently",
        path="integrations/trl/rl_prior.py",
        function="rollout_labels",
        pattern=r"        if differs is not None:\n            problems\.append",
        replacement="        if False:\n            problems.append",
        tests=(f"{RL_PRIOR}::test_a_prompt_rendered_otherwise_is_refused_naming_the_row",),
    ),
    Mutant(
        name="collapse_without_waiting_for_recovery",
        story="the collapse rule flags a reward that dips below half its best without waiting a tenth of the run "
        "for it to come back: a short dip counts as a collapse",
        path="toyworld/grids/rl.py",
        function="collapsed",
        pattern=r"and not any\(later >= best / 2 for later in smooth\[i \+ 1 : i \+ 1 \+ patience\]\)",
        replacement="",
        tests=("tests/toyworld/grids/test_rl.py::test_the_collapse_rule[reward2-loss2-False]",),
    ),
    Mutant(
        name="rl_prompts_keep_the_sft_rows",
        story="the RL prompts are not held out from the sft data: GRPO rewards questions the start was trained on",
        path="toyworld/world/rl.py",
        function="rl_prompts",
        pattern=r" if t\.question not in taken\]",
        replacement="]",
        tests=("tests/toyworld/world/test_rl.py::test_the_prompts_are_the_training_split_without_the_sft_rows",),
    ),
)
