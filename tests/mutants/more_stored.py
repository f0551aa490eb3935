"""Mutants of issue 75: routing-kd's stored-routes forms (the bucket that is 0 at the base); joined into
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
