"""Mutants of the routing monitor: its figures, logs, masks and transform
(issue 48); joined into ``tests.mutants.catalogue.MUTANTS``."""

from __future__ import annotations

from tests.mutants.harness import Mutant

ROUTING = "tests/monitor/test_routing.py"
CALLBACK = "tests/monitor/test_callback.py"
HANDLE = "tests/anchors/test_handle.py"
TRANSFORM = "tests/anchors/test_transform.py"
STATE = f"{CALLBACK}::test_trainer_state_json_holds_the_figures_and_a_second_train_logs_them_again"

MUTANTS: tuple[Mutant, ...] = (
    Mutant(
        name="monitor_figures_in_logs_only",
        story="the monitor adds its figures to the on_log mapping alone: Trainer.log has already copied it into "
        "state.log_history, so trainer_state.json never holds a routing/ key",
        path="monitor/callback.py",
        function="RoutingMonitorCallback.on_log",
        pattern=r"entry\.update\(figures\)",
        replacement="pass",
        tests=(STATE,),
    ),
    Mutant(
        name="monitor_not_reattached",
        story="on_train_begin builds and attaches the monitor only once: on_train_end removed its hooks, so a "
        "second train() on the same trainer logs no routing figure, silently",
        path="monitor/callback.py",
        function="RoutingMonitorCallback.on_train_begin",
        pattern=r"training_only=True\)\n[\s\S]*?self\.monitor\.attach\(\)  # \(again[^\n]*",
        replacement="training_only=True).attach()",
        tests=(STATE,),
    ),
    Mutant(
        name="monitor_unlabelled_forward_silent",
        story="a forward without labels counts every attended token, prompts included, with no word in the log",
        path="monitor/routing.py",
        function="RoutingMonitor._observe",
        pattern=r'self\._mask_source in \("attention", None\) and not self\._said_unlabelled',
        replacement="False",
        tests=(
            f"{ROUTING}::test_forwards_without_labels_count_attended_tokens_said_once_and_a_given_mask_narrows_them",
        ),
    ),
    Mutant(
        name="monitor_given_mask_ignored",
        story="RoutingMonitor.tokens keeps the mask, but the forward still reads the attention mask: a GRPO step's "
        "prompts count in the figures",
        path="monitor/routing.py",
        function="RoutingMonitor._read_mask",
        pattern=r"if self\._given_BT is not None:",
        replacement="if False:",
        tests=(
            f"{ROUTING}::test_forwards_without_labels_count_attended_tokens_said_once_and_a_given_mask_narrows_them",
        ),
    ),
    Mutant(
        name="monitor_alarm_names_no_layer",
        story="the overlap and dead-share alarms say 'a layer', not which decoder layer crossed",
        path="monitor/routing.py",
        function="RoutingMonitor._layers_past",
        pattern=r'return f"layer \{first\}", also',
        replacement='return "a layer", also',
        tests=(
            f"{ROUTING}::test_alarms_name_the_layer_that_crossed",
            f"{CALLBACK}::test_an_alarm_fires_on_a_collapsing_layer_and_stops_training",
        ),
    ),
    Mutant(
        name="kl_to_base_softmax_on_sigmoid_families",
        story="kl-to-base without a prior or a setting reads softmax on a sigmoid family, while the monitor "
        "reads the normalised sigmoid: the monitor does not show the quantity the loss minimises",
        path="anchors/handle.py",
        function="AnchorHandle.router_transform",
        pattern=r"family_transform\(self\.facts\.score_function\)",
        replacement='"softmax"',
        tests=(
            f"{HANDLE}::test_base_router_losses_by_hand_on_valid_tokens[moonlight-kl-to-base-None-sigmoid-normalized]",
            f"{ROUTING}::test_the_monitors_kl_is_the_quantity_kl_to_base_minimises[moonlight-None-softmax]",
        ),
    ),
    Mutant(
        name="megatron_kl_to_base_softmax_on_sigmoid_routers",
        story="the Megatron router's kl-to-base without a transform reads softmax on a sigmoid router, while the "
        "HF path reads the family's normalised sigmoid",
        path="integrations/megatron/router.py",
        function="MegatronAnchorHandle._state",
        pattern=r"family_transform\(r\.module\.score_function\)",
        replacement='"softmax"',
        tests=(
            "tests/integrations/megatron/test_router_losses.py::"
            "test_loss_term_and_its_gradients_against_reference[kl-to-base-sigmoid-bias-groups]",
        ),
    ),
    Mutant(
        name="monitor_kl_ignores_the_anchor",
        story="the monitor reads the family's transform even where the anchor's kl-to-base reads another (the "
        "prior's, or anchor.router_transform): two KLs in one run",
        path="monitor/routing.py",
        function="RoutingMonitor._transform",
        pattern=r"return own or anchor or family_transform",
        replacement="return own or family_transform",
        tests=(
            f"{ROUTING}::test_the_monitors_kl_is_the_quantity_kl_to_base_minimises[qwen3_moe-sigmoid-normalized-softmax]",
        ),
    ),
    Mutant(
        name="prior_transform_ignored_without_override",
        story="the run's transform skips the prior's: a softmax prior on a sigmoid family trains kl-to-base on "
        "the normalised sigmoid",
        path="anchors/transform.py",
        function="run_transform",
        pattern=r"return prior if prior is not None else family_transform\(score_function\)",
        replacement="return family_transform(score_function)",
        tests=(f"{TRANSFORM}::test_the_prior_comes_before_the_family_and_an_override_before_both",),
    ),
    Mutant(
        name="toyworld_transform_not_pinned",
        story="the toy world's cells take the family default: a kl-to-base cell on its DeepSeek-V3-shaped base "
        "reads the normalised sigmoid, and the shipped kl-to-base cells no longer regenerate",
        path="toyworld/world/post.py",
        function="train_cell",
        pattern=r'\{"router_transform": ROUTER_TRANSFORM\} \| ',
        replacement="",
        tests=(f"{TRANSFORM}::test_the_toy_worlds_cells_pin_softmax_as_the_shipped_grids_were_made[kl-to-base]",),
    ),
)
