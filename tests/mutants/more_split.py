"""Mutants of what the split of issue 49 built: the one place that hooks routers (rpb.observe), the command
line's plugins, and the grids' figures; joined into ``tests.mutants.catalogue.MUTANTS``."""

from __future__ import annotations

from tests.mutants.harness import Mutant

HOOKS = "tests/observe/test_hooks.py"
FIGURES = "tests/toyworld/study/test_figures.py"

MUTANTS: tuple[Mutant, ...] = (
    Mutant(
        name="observer_replaces_the_router_output",
        story="a read-only observer's return value replaces the router's output: the monitor or the collector "
        "would change the routing it only meant to read",
        path="observe/hooks.py",
        function="on_router_calls",
        pattern=r"return result if replaces else None",
        replacement="return result",
        tests=(f"{HOOKS}::test_a_replacement_reaches_the_block_only_when_asked_and_every_hook_goes_on_removal",),
    ),
    Mutant(
        name="hooks_left_on_removal",
        story="removing an observation leaves its hooks on the routers: a monitor detached after training keeps "
        "reading, and an anchor removed keeps biasing",
        path="observe/hooks.py",
        function="Hooks.remove",
        pattern=r"h\.remove\(\)",
        replacement="pass",
        tests=(f"{HOOKS}::test_a_replacement_reaches_the_block_only_when_asked_and_every_hook_goes_on_removal",),
    ),
    Mutant(
        name="failed_plugin_swallowed",
        story="a command plugin that fails to load is dropped silently: `rpb demo` says only 'invalid choice' "
        "and nobody learns the toy world did not import",
        path="cli/__init__.py",
        function="_add_plugins",
        pattern=r"failed\.append\(\(f\"\{ep\.name\} = \{ep\.value\}\", traceback\.format_exc\(\)\)\)",
        replacement="pass",
        tests=("tests/test_cli.py::test_a_plugin_that_fails_to_load_is_named_and_the_core_commands_still_run",),
    ),
    Mutant(
        name="forest_intervals_drawn_from_the_mean",
        story="the forest plot draws each interval from its mean to its upper end: the figure hides how far "
        "below zero a method may lie",
        path="toyworld/study/figures.py",
        function="forest",
        pattern=r"\[d\.lo for d in rows\]",
        replacement="[d.mean for d in rows]",
        tests=(f"{FIGURES}::test_the_forest_plot_shows_each_methods_paired_difference_and_interval[beta]",),
    ),
)
