"""Mutants of issue 61: GRPO as people run it (rpb.replay.record's placement by offset, the generation batch's
state, the training-only replay and bias, the precision settings); joined into ``tests.mutants.catalogue.MUTANTS``."""

from __future__ import annotations

from tests.mutants.harness import Mutant

RECORD = "tests/replay/test_record.py"
PATHS = "tests/integrations/trl/test_generation_paths.py"

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
)
