"""Mutants of bugs that passed every test of their feature until these checks: the mixed data's rows and draw, the
online base on packed batches, the base-forward overlap on a family with a correction bias, PR2's learning rate
and the first forward's routes under PR2; joined into ``tests.mutants.catalogue.MUTANTS``."""

from __future__ import annotations

from tests.mutants.harness import Mutant

MIX = "tests/data/test_mix.py"
PACKED = "tests/teacher/test_online_packed.py"
MONITOR = "tests/monitor/test_routing.py"
PR2 = "tests/integrations/trl/test_predictive.py"

MUTANTS: tuple[Mutant, ...] = (
    Mutant(
        name="mix_recorded_but_not_trained",
        story="rpb train records the mixed order in rpb_run.json and then trains the training file's rows unmixed",
        path="train/run.py",
        function="prepare_run",
        pattern=r'examples, info\["data_mix"\] = mixed\.examples, mixed\.record',
        replacement='examples, info["data_mix"] = data.examples, mixed.record',
        tests=(f"{MIX}::test_each_position_trains_the_tokens_of_the_row_its_record_names",),
    ),
    Mutant(
        name="mix_replaces_the_first_rows",
        story="the mixed rows always take the places of the training file's first rows, whatever the seed",
        path="data/mix.py",
        function="mix",
        pattern=r"places = _draw\(n, sum\(takes\), generator\)",
        replacement="places = list(range(sum(takes)))",
        tests=(f"{MIX}::test_the_replaced_places_are_the_documented_draw_and_move_with_the_seed",),
    ),
    Mutant(
        name="online_base_drops_the_positions",
        story="the online base's forward drops position_ids: on a packed row, which has no attention mask, every "
        "example after the first reads the ones before it, and routing-kd holds the model to another routing",
        path="teacher/online.py",
        function="OnlineBase.step",
        pattern=r"for k in FORWARD_KEYS if inputs\.get\(k\) is not None",
        replacement='for k in FORWARD_KEYS if k != "position_ids" and inputs.get(k) is not None',
        tests=(
            f"{PACKED}::test_each_packed_examples_base_routing_is_its_own_unpacked_forwards",
            f"{PACKED}::test_step_one_of_a_packed_routing_kd_run_logs_an_anchor_term_of_zero",
        ),
    ),
    Mutant(
        name="base_forward_overlap_without_the_expert_bias",
        story="the monitor chooses the base forward's experts without the frozen expert-correction bias: on "
        "DeepSeek-V3 the base-forward overlap compares two different rules",
        path="monitor/routing.py",
        function="RoutingMonitor._observe_base_forward",
        pattern=r'ids_base_TK = select\(base_TE, spec, None, frozen\["expert_bias"\]\)',
        replacement="ids_base_TK = select(base_TE, spec, None, None)",
        tests=(f"{MONITOR}::test_the_base_forward_overlap_on_a_family_with_bias_and_groups_is_the_routers_own",),
    ),
    Mutant(
        name="pr2_lr_scale_not_applied",
        story="PR2's predictor learns at the model's learning rate: pr2_lr_scale is accepted and never applied",
        path="integrations/trl/predictive.py",
        function="PredictiveReplay.create_optimizer",
        pattern=r"lr = self\.args\.learning_rate \* self\.args\.pr2_lr_scale",
        replacement="lr = self.args.learning_rate",
        tests=(f"{PR2}::test_the_predictors_optimizer_group_has_the_scaled_learning_rate_and_no_weight_decay",),
    ),
    Mutant(
        name="pr2_first_routes_are_the_predictors",
        story="under PR2 the batch's first-forward routes hold the predictor's choice, not the routers' own: the "
        "rollout flip rate compares the rollout with the predictor",
        path="integrations/trl/grpo.py",
        function="GRPOTrainer._first_forward",
        pattern=r"state\.first_routes = self\.replay\.native_BSLK",
        replacement="state.first_routes = self.replay.chosen_BSLK if self.pr2 is not None else self.replay.native_BSLK",
        tests=(f"{PR2}::test_under_pr2_the_first_routes_and_the_flip_rate_read_the_routers_own_choice",),
    ),
)
