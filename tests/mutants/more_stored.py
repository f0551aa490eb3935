"""Mutants of issue 75: routing-kd's stored-routes forms (the bucket and the hinge, 0 at the base; --top-m) and the two
controls of why it holds; joined into
``tests.mutants.catalogue.MUTANTS``."""

from __future__ import annotations

from tests.mutants.harness import Mutant

METHODS = "tests/anchors/test_methods.py"
MATRIX = "tests/teacher/test_routing_kd_matrix.py"

MUTANTS: tuple[Mutant, ...] = (
    Mutant(
        name="bucket_left_out",
        story="the stored-routes KL keeps only the stored experts' cells: the rest of the distribution is dropped, so "
        "the term is no longer 0 at the base's own routing and not the online KL with every expert stored",
        path="losses.py",
        function="routing_kd_bucket",
        pattern=r"return _masked_mean_T\(stored_T \+ rest_T, valid_T\)",
        replacement="return _masked_mean_T(stored_T, valid_T)",
        tests=(
            f"{METHODS}::test_the_bucket_form_is_0_at_the_base_and_with_every_expert_stored_is_online_routing_kds_kl",
        ),
    ),
    Mutant(
        name="stored_probabilities_renormalised_in_the_bucket",
        story="the bucket form renormalises the stored probabilities over the stored experts, as the earlier form "
        "did: q's rest is 0 and the term pulls the model's whole mass onto the base's k",
        path="losses.py",
        function="routing_kd_bucket",
        pattern=r"q_TM = base_probs_TM\.float\(\)\n",
        replacement="q_TM = base_probs_TM.float() / base_probs_TM.float().sum(-1, keepdim=True)\n",
        tests=(f"{MATRIX}::test_stored_routing_kd_is_the_hand_set_cross_entropy_and_top_k_kl",),
    ),
)

HF_ROUTES = "tests/collect/test_hf_routes.py"
HINGE_GROUPS = "test_the_ids_alone_hinge_holds_the_groups_and_the_correction_bias_worked_by_hand"
WHOLE = "test_a_whole_distribution_route_file_is_online_routing_kd"

MUTANTS += (
    Mutant(
        name="hinge_rivals_from_every_group",
        story="the ids-alone hinge takes the base's rivals from every expert, not the groups the model's rule keeps: "
        "it is active where the rule still returns the base's set (a likelier expert in a group the rule drops)",
        path="losses.py",
        function="routing_kd_hinge",
        pattern=r"rivals_TE = rivals_TE & kept_TG\.repeat_interleave\(per, dim=1\)",
        replacement="rivals_TE = rivals_TE",
        tests=(f"{METHODS}::{HINGE_GROUPS}",),
    ),
    Mutant(
        name="hinge_group_bar_left_out",
        story="the ids-alone hinge drops its group part: where the rule stops keeping one of the base's groups, only "
        "the experts' margin is left to hold it",
        path="losses.py",
        function="routing_kd_hinge",
        pattern=r"term_T = term_T \+ torch\.where\(bar_T\.isfinite\(\)",
        replacement="term_T = term_T + 0 * torch.where(bar_T.isfinite()",
        tests=(f"{METHODS}::{HINGE_GROUPS}",),
    ),
    Mutant(
        name="extra_stored_experts_ignored",
        story="the bucket form reads the route file's top-k alone and drops the experts --top-m stored beyond it: a "
        "whole-distribution file no longer gives online routing-kd's term",
        path="anchors/methods.py",
        function="_routing_kd",
        pattern=r"if s\.routing_extra_ids_TJ is not None:",
        replacement="if False:",
        tests=(f"{MATRIX}::{WHOLE}",),
    ),
    Mutant(
        name="next_experts_repeat_the_routed",
        story="rpb routes --top-m ranks the extra experts among all, the routed ones included: the file stores the "
        "likeliest routed experts twice and misses others",
        path="collect/hf_routes.py",
        function="next_experts",
        pattern=r"outside_BPLE = probs_BPLE\.scatter\(-1, routes_BPLK, -1\.0\)",
        replacement="outside_BPLE = probs_BPLE",
        tests=(f"{HF_ROUTES}::test_with_probs_stores_the_routers_probabilities_at_the_routed_experts",),
    ),
)

CONTROLS = "tests/anchors/test_methods_controls.py"

MUTANTS += (
    Mutant(
        name="router_only_input_not_detached",
        story="the router-only control computes its logits on the router's input with its graph: its gradient "
        "reaches every layer below, so it is routing-kd again and controls nothing",
        path="anchors/handle.py",
        function="AnchorHandle._loss_term",
        pattern=r"hidden_TH = hidden\.reshape\(-1, hidden\.shape\[-1\]\)\.detach\(\)\.float\(\)",
        replacement="hidden_TH = hidden.reshape(-1, hidden.shape[-1]).float()",
        tests=(f"{CONTROLS}::test_router_only_is_routing_kds_term_with_its_gradient_on_the_routers_alone",),
    ),
    Mutant(
        name="hidden_kd_not_relative",
        story="hidden-kd's drift is not divided by the base's hidden-state size: its scale, and what a λ means, "
        "follow each model's activation norms",
        path="losses.py",
        function="hidden_kd",
        pattern=r"return drift / _masked_mean_T",
        replacement="return drift + 0 * _masked_mean_T",
        tests=(f"{CONTROLS}::test_hidden_kd_is_the_relative_drift_of_each_routers_input_from_the_bases",),
    ),
)

MUTANTS += (
    Mutant(
        name="route_file_held_whole",
        story="the stored-routes teacher reads every tensor of the route file into memory, as it did before: a "
        "100M-token set's routes then need their whole size of RAM in every process",
        path="teacher/stored.py",
        function="load_stored_routes",
        pattern=r"    form = routes_loss_form\(routes_loss, routes\.has_probs\)\n",
        replacement="    form = routes_loss_form(routes_loss, routes.has_probs)\n"
        "    routes.held = [routes.whole(name) for name in routes.stated]\n",
        tests=("tests/teacher/test_stored_mapped.py::test_a_route_file_larger_than_the_data_limit_trains",),
    ),
)

SHARDS = "tests/replay/test_routeshards.py::test_shards_are_the_single_file_to_every_reader_and_a_killed_run_resumes"

MUTANTS += (
    Mutant(
        name="shard_read_at_the_global_row",
        story="a shard directory reads row r of the shard that holds it as that shard's own row r: every row after "
        "the first shard gets another row's routes, or none",
        path="replay/routeshards.py",
        function="RouteShards._at",
        pattern=r"return self\.parts\[i\], row - self\.starts\[i\]",
        replacement="return self.parts[i], min(row, self.parts[i].num_rows - 1)",
        tests=(SHARDS,),
    ),
    Mutant(
        name="finished_chunks_redone_on_resume",
        story="a resumed sharded run lists no chunk as finished: every shard (or chunk of a prior) is computed "
        "again after a kill",
        path="collect/store.py",
        function="missing_chunks",
        pattern=r"todo = \[c for c in store\.chunks if c not in done\]",
        replacement="todo = list(store.chunks)",
        tests=(SHARDS,),
    ),
)

MUTANTS += (
    Mutant(
        name="hinge_margin_sign_flipped",
        story="the ids-alone hinge measures the base's weakest expert above its strongest rival: active where the "
        "rule keeps the base's set, 0 where it loses it",
        path="losses.py",
        function="routing_kd_hinge",
        pattern=r"\(rival_T - weakest_T\)\.clamp_min\(0\)",
        replacement="(weakest_T - rival_T).clamp_min(0)",
        tests=(f"{METHODS}::test_the_ids_alone_hinge_is_the_rules_margin_worked_by_hand",),
    ),
    Mutant(
        name="hinge_ignores_the_correction_bias",
        story="the ids-alone hinge ranks a sigmoid router's experts without its expert-correction bias: not the "
        "rule DeepSeek-V3 selects by, so it holds sets the model would not choose",
        path="losses.py",
        function="selection_scores",
        pattern=r"return s_TE if expert_bias_E is None else s_TE \+ expert_bias_E\.float\(\)",
        replacement="return s_TE",
        tests=(f"{METHODS}::{HINGE_GROUPS}",),
    ),
    Mutant(
        name="hidden_kd_reads_the_models_own_hidden_states",
        story="hidden-kd compares each router's input with itself rather than with the base's: a term of 0 that "
        "holds nothing",
        path="anchors/base_state.py",
        function="base_into",
        pattern=r"state\.base_hidden_TH = base\.hidden_LTH\[pos\]\.to\(device\)",
        replacement="state.base_hidden_TH = state.hidden_TH.detach()",
        tests=(f"{CONTROLS}::test_hidden_kd_is_the_relative_drift_of_each_routers_input_from_the_bases",),
    ),
)
