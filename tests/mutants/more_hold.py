"""Mutants of issue 63 (hold the routing): data mixing, routing-kd's base (online, stored, GRPO's reference), and
PEFT's adapters around the base forward; joined into ``tests.mutants.catalogue.MUTANTS``."""

from __future__ import annotations

from tests.mutants.harness import Mutant

MIX = "tests/data/test_mix.py"
MATRIX = "tests/teacher/test_routing_kd_matrix.py"
ONLINE = "tests/teacher/test_online.py"
GRPO = "tests/integrations/trl/test_base_routing.py"
AFTER_EACH = "test_after_each_base_forward_the_adapters_are_on_and_the_model_computes_the_merged_one"

MUTANTS: tuple[Mutant, ...] = (
    Mutant(
        name="mix_places_drawn_with_replacement",
        story="the places the mixed rows take are drawn with replacement: a mixed row lands on a place another "
        "already took, so a mixed row is lost and a training row the record says was replaced trains instead",
        path="data/mix.py",
        function="mix",
        pattern=r"places = _draw\(n, sum\(takes\), generator\)",
        replacement="places = torch.randint(n, (sum(takes),), generator=generator).tolist()",
        tests=(f"{MIX}::test_the_mixed_rows_take_the_places_drawn_and_every_row_appears_once",),
    ),
    Mutant(
        name="routing_kd_base_on_the_training_hidden_states",
        story="routing-kd's q is the base router applied to the training model's hidden states, not the base's own "
        "forward: it is kl-to-base again, blind to the drift of the hidden states",
        path="anchors/handle.py",
        function="AnchorHandle._loss_term",
        pattern=r"self\._base_routing_into\(state, layer, logits_TE\)",
        replacement="self._base_routing_into(state, layer, logits_TE); state.routing_logits_TE = "
        "nn.functional.linear(hidden.reshape(-1, hidden.shape[-1]).float(), "
        "self.teacher.module.get_submodule(layer.moe.name).weight.float())",
        tests=(f"{MATRIX}::test_online_routing_kd_is_the_hand_kl_between_two_forwards[qwen3_30b_a3b]",),
    ),
    Mutant(
        name="routing_kd_q_and_p_swapped",
        story="routing-kd computes KL(p || q), the training model's routing against the base's: another divergence, "
        "which does not pull towards the base's choice as the methods table says",
        path="anchors/methods.py",
        function="_routing_kd",
        pattern=r"losses\.kl_to_base\(s\.logits_TE, s\.routing_logits_TE, s\.valid_T, s\.transform\)",
        replacement="losses.kl_to_base(s.routing_logits_TE, s.logits_TE, s.valid_T, s.transform)",
        tests=(f"{MATRIX}::test_online_routing_kd_is_the_hand_kl_between_two_forwards[qwen3_30b_a3b]",),
    ),
    Mutant(
        name="stored_routes_shifted_by_one_token",
        story="each token reads the stored route of the token before it: the base's routing of another token",
        path="teacher/stored.py",
        function="StoredRoutes.token_index",
        pattern=r"at_BS = positions_in_row\(sample_BT\)",
        replacement="at_BS = (positions_in_row(sample_BT) - 1).clamp_min(0)",
        tests=(f"{MATRIX}::test_stored_routing_kd_is_the_hand_set_cross_entropy_and_top_k_kl[qwen3_30b_a3b]",),
    ),
    Mutant(
        name="adapters_left_off_after_the_base_forward",
        story="the base forward disables the LoRA adapters and never enables them again: the training forward runs "
        "the base, the adapters get no gradient, and the run trains nothing while its loss looks normal",
        path="teacher/online.py",
        function="OnlineBase._base_mode",
        pattern=r"\n( +)with model\.disable_adapter\(\):\n +yield model",
        replacement=r"\n\1model.base_model.disable_adapter_layers()\n\1yield model",
        tests=(f"{ONLINE}::{AFTER_EACH}",),
    ),
    Mutant(
        name="reference_routing_attached_to_another_row",
        story="GRPO's batch dict carries the reference model's routing one row off: after TRL's shuffle each "
        "completion is held to another completion's base routing",
        path="integrations/trl/grpo.py",
        function="GRPOTrainer._attach",
        pattern=r"output\[BASE_ROUTING\] = state\.base_routing\.to\(device\)",
        replacement="output[BASE_ROUTING] = state.base_routing.roll(1, 0).to(device)",
        tests=(f"{GRPO}::test_the_term_is_the_hand_kl_on_the_reference_models_routing_row_by_row",),
    ),
)
