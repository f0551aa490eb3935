"""Mutants of issue 52: priors from an engine's routes (rpb.collect.from_routes, hf_routes; the selection sums in
rpb.prior), the frequency grid's claim and borrowed cells; and of issue 53's router revert (rpb.adapters.revert);
joined into ``tests.mutants.catalogue.MUTANTS``."""

from __future__ import annotations

from tests.mutants.harness import Mutant

FROM_ROUTES = "tests/collect/test_from_routes.py"
HF_ROUTES = "tests/collect/test_hf_routes.py"
FREQUENCY = "tests/toyworld/grids/test_beta_frequency.py"
REVERT = "tests/adapters/test_revert.py"
REVERT_NLL = "tests/retention/test_revert.py"
REVERT_GRID = "tests/toyworld/grids/test_revert.py"
REVERT_STUDY = "tests/toyworld/grids/test_revert_study.py"

MUTANTS: tuple[Mutant, ...] = (
    Mutant(
        name="routes_prompt_counted_in_the_answer_span",
        story="the reader labels the prompt's tokens as answer tokens: the answer span's prior is the whole row's",
        path="collect/from_routes.py",
        function="frequency_prior",
        pattern=r"span_1N = torch\.tensor\(\[ex\.span_ids\]\)",
        replacement="span_1N = torch.tensor([[1 if s == 0 else s for s in ex.span_ids]])",
        tests=(f"{FROM_ROUTES}::test_a_prior_from_vllm_layout_routes_is_the_hand_frequency_prior",),
    ),
    Mutant(
        name="frequency_topk_division_forgotten",
        story="each chosen expert counts 1, not 1/k: a frequency prior's rows sum to k, and its bias is another one",
        path="prior/math.py",
        function="selection_sums",
        pattern=r"chosen_BTE\.scatter_\(-1, ids_BTK\.long\(\), 1\.0 / top_k\)",
        replacement="chosen_BTE.scatter_(-1, ids_BTK.long(), 1.0)",
        tests=(f"{FROM_ROUTES}::test_a_prior_from_vllm_layout_routes_is_the_hand_frequency_prior",),
    ),
    Mutant(
        name="routes_padding_positions_kept",
        story="rpb routes keeps the routes of a batch's padding after a shorter row's last token: more routes than "
        "the row has tokens, where vLLM returns one per token of a prefill-only request",
        path="collect/hf_routes.py",
        function="hf_routes",
        pattern=r"n = len\(examples\[i\]\)\n(\s+)routes_NXK",
        replacement=r"n = P\n\1routes_NXK",
        tests=(f"{HF_ROUTES}::test_routes_are_the_routers_own_choices_laid_out_per_decoder_layer",),
    ),
    Mutant(
        name="routes_count_not_checked",
        story="a route file with a token's route missing (prefix caching left on) is read without a word naming it",
        path="collect/from_routes.py",
        function="row_routes",
        pattern=r"if raw_SXK\.shape\[0\] != len\(example\):",
        replacement="if False:",
        tests=(f"{FROM_ROUTES}::test_refused_shifted_tokens_a_short_route_count_and_every_problem_at_once",),
    ),
    Mutant(
        name="routes_fingerprint_not_checked",
        story="routes another model returned make a prior tied to this one: its bias describes the other's routing",
        path="collect/from_routes.py",
        function="_file_problems",
        pattern=r'if meta\.get\("routers_sha256"\) not in \(None, model\.checkpoint\.routers_sha256\):',
        replacement="if False:",
        tests=(f"{FROM_ROUTES}::test_refused_routes_of_another_model",),
    ),
    Mutant(
        name="routes_moe_layers_at_the_first_columns",
        story="rpb routes writes the MoE layers' routes into the first decoder-layer columns, not at their own "
        "indices: a model with dense layers first gets its layers shifted",
        path="collect/hf_routes.py",
        function="hf_routes",
        pattern=r"routes_NXK\[:, at\] = ",
        replacement="routes_NXK[:, : len(at)] = ",
        tests=(f"{HF_ROUTES}::test_routes_are_the_routers_own_choices_laid_out_per_decoder_layer",),
    ),
    Mutant(
        name="frequency_judged_at_the_asked_margin",
        story="every frequency claim is judged at ±1 whatever margin its name says: the measured margins are never "
        "tested",
        path="toyworld/grids/beta_frequency.py",
        function="judge_frequency",
        pattern=r"equivalent\(claim, d, margin, note\)",
        replacement="equivalent(claim, d, ASKED_MARGIN, note)",
        tests=(f"{FREQUENCY}::test_verdicts_on_hand_made_cells",),
    ),
    Mutant(
        name="frequency_borrows_another_bases_cells",
        story="a grid copies another grid's shipped cells (the frequency grid the beta grid's, hold-stored hold's and "
        "hold-target's) without checking that they pin the same base weights and recipe: its pairs may mix two bases",
        path="toyworld/study/paired.py",
        function="shipped_base",
        pattern=r"return base if all\(theirs\.get\(k\) == ours\.get\(k\) "
        r'for k in \("post_recipe", "base_sha256"\)\) else None',
        replacement="return base",
        tests=(
            "tests/toyworld/study/test_paired.py::test_probability_cells_are_the_shipped_beta_grids_files",
            "tests/toyworld/grids/test_hold_stored.py::test_without_a_shipped_base_of_the_same_pins_every_cell_is_trained_here",
        ),
    ),
    Mutant(
        name="revert_only_the_router_weight",
        story="the revert copies each router's weight and leaves its expert-correction bias (and gpt-oss's router "
        "bias) as the post-training left them: the routing does not go back",
        path="adapters/revert.py",
        function="put_routers",
        pattern=r"for name, t in ours\.items\(\):",
        replacement="for name, t in list(ours.items())[:1]:",
        tests=(f"{REVERT}::test_a_model_that_differs_only_in_its_routers_gives_the_sources_logits[deepseek_v3]",),
    ),
    Mutant(
        name="revert_router_bias_left_unreverted",
        story="the revert copies the router's weight and expert bias but not gpt-oss's router bias, which sits inside "
        "its logits: the 'reverted' model still routes with the post model's bias",
        path="adapters/revert.py",
        function="_tensors",
        pattern=r"found = dict\(router_tensors\(layer, facts\)\)",
        replacement="found = {k: v for k, v in router_tensors(layer, facts).items() if k != facts.router_bias}",
        tests=(f"{REVERT}::test_the_base_routers_go_back_and_nothing_else_moves",),
    ),
    Mutant(
        name="revert_expert_bias_into_the_wrong_layer",
        story="the expert-correction bias is taken from the base's previous MoE layer (an off-by-one over the layer "
        "list, which a buffer kept on the router or on MiniMax-M2's block invites): every layer selects with "
        "another layer's bias",
        path="adapters/revert.py",
        function="put_routers",
        pattern=r"theirs, ours = _tensors\(source, s, facts, shared_gates\), _tensors\(into, d, facts, shared_gates\)",
        replacement="theirs, ours = {**_tensors(source, s, facts, shared_gates), **{k: v for k, v in _tensors(source, "
        "src[dst.index(d) - 1], facts, shared_gates).items() if k == facts.expert_bias}}, "
        "_tensors(into, d, facts, shared_gates)",
        tests=(f"{REVERT}::test_the_base_routers_go_back_and_nothing_else_moves",),
    ),
    Mutant(
        name="revert_nll_over_the_prompt_span",
        story="the revert's NLL reads every token, the prompt's too: a change in how the model reads questions "
        "passes for a change in how it answers",
        path="retention/revert.py",
        function="measure_domain",
        pattern=r'labels_for\(e, "answer"\)',
        replacement='labels_for(e, "all")',
        tests=(
            f"{REVERT_NLL}::test_each_rows_answer_nll_is_its_own_forward_read_by_hand",
            f"{REVERT_NLL}::test_the_prompt_span_is_not_in_the_nll",
        ),
    ),
    Mutant(
        name="revert_claim_judged_the_wrong_way",
        story="the trained domain's part of the revert claim is judged as a fall in NLL, not a rise: a reproduced "
        "claim reads as contradicted",
        path="toyworld/grids/revert.py",
        function="judge_revert",
        pattern=r"\(TRAINED,\), 1\)",
        replacement="(TRAINED,), -1)",
        tests=(f"{REVERT_GRID}::test_the_claim_is_judged_on_the_cells_changes",),
    ),
    Mutant(
        name="revert_rl_arm_not_reverted_to_its_start",
        story="an RL cell is reverted to the base's routers only: the issue's second reference, the sft start's "
        "routers, is silently missing from the grid",
        path="toyworld/grids/revert.py",
        function="RevertStudy.measure",
        pattern=r'if "start_sha256" in result else \{\}',
        replacement="if False else {}",
        tests=(f"{REVERT_STUDY}::test_an_rl_arm_trains_through_the_rl_study_and_is_reverted_to_its_start",),
    ),
)
