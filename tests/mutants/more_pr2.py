"""Mutants of issue 64 (when the routing goes stale): PR2's predictor and the stale figure; joined into
``tests.mutants.catalogue.MUTANTS``."""

from __future__ import annotations

from tests.mutants.harness import Mutant

UNIT = "tests/replay/test_predictive.py"
DISTRIBUTED = "tests/integrations/trl/test_grpo_distributed.py"
PR2 = "tests/integrations/trl/test_predictive.py"
STALE = f"{PR2}::test_the_stale_figure_is_the_hand_count_at_every_update_index"
RECORDED = "test_the_recorded_experts_are_the_familys_selection_on_router_plus_predictor_gates_unbiased"

MUTANTS: tuple[Mutant, ...] = (
    Mutant(
        name="pr2_predictor_trained_on_the_first_update",
        story="the predictor learns in a batch's first update too, where the live router is the recorded one: it is "
        "pulled back toward zero by every batch's first update",
        path="integrations/trl/predictive.py",
        function="PredictiveReplay._train_predictor",
        pattern=r'micro\["update"\] < 1',
        replacement='micro["update"] < 0',
        tests=(f"{STALE}[PR2-qwen3_moe]",),
    ),
    Mutant(
        name="pr2_predictor_logits_in_the_gates",
        story="the recording forward's gates are taken from the router's logits plus the predictor's: the "
        "correction weighs the experts' outputs, not only their choice",
        path="replay/replay.py",
        function="RouteReplay._predicted",
        pattern=r"new_gates_TK = combine_weights\(logits_TE, ids_TK, spec\)",
        replacement="new_gates_TK = combine_weights(logits_TE + delta_TE.to(logits_TE.dtype), ids_TK, spec)",
        tests=(f"{UNIT}::{RECORDED}[qwen3_moe]",),
    ),
    Mutant(
        name="pr2_stop_gradient_dropped",
        story="the predictor's target keeps its graph: the predictor's loss pushes the router (and everything "
        "upstream) toward the recorded logits plus the predicted drift",
        path="replay/predictive.py",
        function="predictor_loss",
        pattern=r"live_TE = live_BCLE\[:, :, pos\]\.reshape\(-1, live_BCLE\.shape\[-1\]\)\.detach\(\)\.float\(\)",
        replacement="live_TE = live_BCLE[:, :, pos].reshape(-1, live_BCLE.shape[-1]).float()",
        tests=(f"{UNIT}::test_the_predictors_gradient_is_the_hand_kl_and_the_routers_is_r2s[qwen3_moe-softmax]",),
    ),
    Mutant(
        name="stale_figure_over_prompt_tokens",
        story="the stale figure counts the prompt's positions too: a prompt routes alike in every update, so the "
        "figure is diluted by tokens that cannot go stale",
        path="integrations/trl/rollouts.py",
        function="RolloutRoutes._log_stale",
        pattern=r"count_BS = completion_BS & routed_positions\(against\)",
        replacement="count_BS = routed_positions(against)",
        tests=(f"{STALE}[R2-qwen3_moe]",),
    ),
    Mutant(
        name="off_stale_figure_against_the_rollout",
        story="under off the stale figure compares the live choice with the rollout's routes: it reports the "
        "engine's precision gap as staleness",
        path="integrations/trl/rollouts.py",
        function="RolloutRoutes._log_stale",
        pattern=r'micro\["inputs"\]\.get\("rpb_first_routes"\)',
        replacement='micro["inputs"].get("rpb_rollout_routes")',
        tests=(f"{STALE}[off-qwen3_moe]",),
    ),
    Mutant(
        name="pr2_predictor_gradients_left_per_rank",
        story="on several processes each rank steps its predictor on its own rows' gradient: the ranks' predictors "
        "drift apart, and each routes its next batch by another predictor",
        path="integrations/trl/predictive.py",
        function="PredictiveReplay.create_optimizer",
        pattern=r"if self\.accelerator\.num_processes > 1:",
        replacement="if False:",
        tests=(f"{DISTRIBUTED}::test_pr2_on_two_processes_takes_the_one_processs_predictor_step",),
    ),
)
