"""Mutants of issue 51: the ``rl`` grid's runner (rpb.toyworld.study.rl), report and figure (rl_report,
rl_figures); joined into ``tests.mutants.catalogue.MUTANTS``."""

from __future__ import annotations

from tests.mutants.harness import Mutant

STUDY = "tests/toyworld/study/test_rl.py"
REPORT = "tests/toyworld/study/test_rl_report.py"
FIGURES = "tests/toyworld/study/test_rl_figures.py"

MUTANTS: tuple[Mutant, ...] = (
    Mutant(
        name="rl_prior_from_the_base",
        story="the rpb arm's prior is collected with the base instead of the sft start the RL run post-trains: "
        "its bias pulls towards a routing the start has already left",
        path="toyworld/study/rl.py",
        function="RLStudy.rl_prior",
        pattern=r"str\(self\.start\(\)\),",
        replacement="str(self.base()),",
        tests=(f"{STUDY}::test_the_prompts_are_held_out_and_the_prior_is_the_starts",),
    ),
    Mutant(
        name="rl_start_hash_not_checked",
        story="a resumed base retrains its start and takes whatever weights come out: cells of two starts mix",
        path="toyworld/study/rl.py",
        function="RLStudy.start",
        pattern=r"if recorded is not None and recorded\[\"weights_sha256\"\] != sha:",
        replacement="if False:",
        tests=(f"{STUDY}::test_a_start_that_trains_to_other_weights_is_refused",),
    ),
    Mutant(
        name="rl_retention_against_the_base_twice",
        story="the retention 'against the start' is measured against the base: claim 1 reads the wrong overlap",
        path="toyworld/study/rl.py",
        function="RLStudy.measure",
        pattern=r"\(\"start\", self\.start\(\)\)",
        replacement='("start", self.base())',
        tests=(f"{STUDY}::test_retention_against_the_start_and_the_base_is_rpb_retentions",),
    ),
    Mutant(
        name="rl_difference_against_itself",
        story="the scores table pairs each arm with itself instead of plain GRPO: every difference reads 0",
        path="toyworld/study/rl_report.py",
        function="_difference",
        pattern=r"paired_differences\(results, post_set, arm, plain, metric\)",
        replacement="paired_differences(results, post_set, arm, arm, metric)",
        tests=(f"{REPORT}::test_a_difference_is_the_arm_minus_plain_grpo_on_the_same_seed",),
    ),
    Mutant(
        name="rl_band_without_the_running_mean",
        story="the figure draws each cell's raw values as if smoothed: the caption's running mean is not drawn",
        path="toyworld/study/rl_figures.py",
        function="rl_figure",
        pattern=r"band\(\[running_mean\(values\) for _, values in traced\]\)",
        replacement="band([values for _, values in traced])",
        tests=(f"{FIGURES}::test_the_figure_draws_each_arms_cells",),
    ),
)
