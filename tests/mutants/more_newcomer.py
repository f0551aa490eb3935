"""Mutants of the rows a new user's data file holds: empty messages, dry runs, truncation
(issue 48); joined into ``tests.mutants.catalogue.MUTANTS``."""

from __future__ import annotations

from tests.mutants.harness import Mutant

DATASET = "tests/data/test_dataset.py"
DRY = "tests/train/test_dryrun.py"
EMPTY = f"{DATASET}::test_an_empty_message_is_named_as_empty_not_as_a_span_cut_by_max_seq_len"
COUNTED = f"{DATASET}::test_rows_longer_than_max_seq_len_are_counted"
BAD_ROWS = f"{DRY}::test_a_dry_run_lists_every_bad_row_as_the_real_run_reports_it"
AT_ONCE = f"{DRY}::test_a_dry_run_lists_the_prior_its_settings_and_the_rows_at_once"
TRAIN_COUNT = "tests/train/test_run.py::test_rows_cut_by_max_seq_len_are_counted_in_the_log_and_in_rpb_run_json"
COLLECT_COUNT = "tests/test_cli.py::test_collect_counts_the_rows_cut_by_max_seq_len_in_the_log_and_the_prior"

MUTANTS: tuple[Mutant, ...] = (
    Mutant(
        name="empty_message_reported_as_no_tokens",
        story="an empty assistant message is reported as 'the A span has no tokens within max_seq_len', sending "
        "the user after a truncation that never happened",
        path="data/dataset.py",
        function="_no_tokens",
        pattern=r"empty = _empty_messages\(row\.messages, roles\)",
        replacement="empty = []",
        tests=(EMPTY,),
    ),
    Mutant(
        name="dry_run_checks_the_configuration_alone",
        story="rpb train --dry-run loads the configuration and says 'configuration OK' on a data file with 4 bad rows",
        path="cli/training.py",
        function="_train",
        pattern=r"print\(dry_run\(args\.config, args\.overrides\)\.summary\(\)\)",
        replacement='print(__import__("rpb.train.config", fromlist=["load_config"]).load_config(args.config, '
        'args.overrides) and "configuration OK")',
        tests=(BAD_ROWS,),
    ),
    Mutant(
        name="dry_run_skips_the_rows",
        story="the dry run checks the prior and the settings but never labels the rows: bad rows pass it",
        path="train/dryrun.py",
        function="dry_run",
        pattern=r"data = _rows\(",
        replacement="data = None and _rows(",
        tests=(BAD_ROWS,),
    ),
    Mutant(
        name="dry_run_skips_the_prior_file",
        story="the dry run reads the prior's metadata but not its values or its data: a NaN prior passes it",
        path="train/dryrun.py",
        function="_prior",
        pattern=r'problems \+= \[f"prior: \{p\}" for p in validate_artifact\(cfg\.prior, data_jsonl=data\)\.problems\]',
        replacement="pass",
        tests=(AT_ONCE,),
    ),
    Mutant(
        name="dry_run_skips_the_prior_settings",
        story="the dry run never compares the prior with the run: another max_seq_len or template kwargs pass it",
        path="train/dryrun.py",
        function="dry_run",
        pattern=r"_settings\(cfg, tokenizer, meta, max_seq_len, problems\)",
        replacement="pass",
        tests=(AT_ONCE,),
    ),
    Mutant(
        name="truncation_counts_rows_that_fit_exactly",
        story="a row of exactly max_seq_len tokens is counted as cut",
        path="data/dataset.py",
        function="label_row",
        pattern=r"len\(ids\) > max_seq_len",
        replacement="len(ids) >= max_seq_len",
        tests=(COUNTED,),
    ),
    Mutant(
        name="truncated_rows_not_in_rpb_run_json",
        story="rpb train counts the rows it cut but rpb_run.json does not record them",
        path="train/run.py",
        function="attach_anchor",
        pattern=r'\n\s*"truncated_rows": data\.truncated_rows,',
        replacement="",
        tests=(TRAIN_COUNT,),
    ),
    Mutant(
        name="truncated_rows_not_logged_by_train",
        story="rpb train records the rows it cut in rpb_run.json but says nothing when it starts",
        path="train/run.py",
        function="prepare_run",
        pattern=r"note_truncated\(data\.truncated_rows, data\.num_rows, max_seq_len\)",
        replacement="None",
        tests=(TRAIN_COUNT,),
    ),
    Mutant(
        name="truncated_rows_not_in_the_prior",
        story="rpb collect says how many rows it cut, but the prior's metadata does not record it",
        path="collect/record.py",
        function="scan_data",
        pattern=r'"truncated_rows": template\.truncated_rows,\n\s*',
        replacement="",
        tests=(COLLECT_COUNT,),
    ),
    Mutant(
        name="truncated_rows_not_logged_by_collect",
        story="rpb collect records the rows it cut in the prior but says nothing before it computes",
        path="collect/record.py",
        function="scan_data",
        pattern=r"note_truncated\(template\.truncated_rows, rows\.num_rows, max_seq_len\)",
        replacement="None",
        tests=(COLLECT_COUNT,),
    ),
)
