"""Mutants of a prior's values and tensor hash, checked by every command that reads one
(issue 48); joined into ``tests.mutants.catalogue.MUTANTS``."""

from __future__ import annotations

from tests.mutants.harness import Mutant

CHECKS = "tests/prior/test_checks.py"
COLLECTOR = "tests/collect/test_collector.py"
#: the raw reader, as a regression back to it would call it (the mutated modules import only load_prior)
RAW = '__import__("rpb.prior.artifact", fromlist=["load_artifact"]).load_artifact'

MUTANTS: tuple[Mutant, ...] = (
    Mutant(
        name="load_prior_skips_value_checks",
        story="the checked loader checks the metadata's hash but not the values: a NaN prior trains",
        path="prior/checks.py",
        function="load_prior",
        pattern=r"problems = file_problems\(path, art\)",
        replacement="problems = hash_problems(path, art.metadata)",
        tests=(f"{CHECKS}::test_train_refuses[nan]", f"{CHECKS}::test_experts_refuses[negative]"),
    ),
    Mutant(
        name="load_prior_skips_tensor_hash",
        story="the checked loader checks the values but never the tensor hash: a flipped bit trains",
        path="prior/checks.py",
        function="load_prior",
        pattern=r"problems = file_problems\(path, art\)",
        replacement="problems = metadata_problems(art.metadata) + tensor_problems(art)",
        tests=(f"{CHECKS}::test_train_refuses[bitflip]",),
    ),
    Mutant(
        name="hash_placeholder_left_unpatched",
        story="the streamed writer never patches the placeholder: every collected prior records 64 zeros",
        path="prior/artifact.py",
        function="write_streamed",
        pattern=r"f\.write\(digest\.hexdigest\(\)\.encode\(\)\)",
        replacement="pass",
        tests=(
            f"{COLLECTOR}::test_a_streamed_artifact_gets_the_hash_of_its_bytes_in_place",
            f"{CHECKS}::test_the_recorded_hash_is_the_files_own",
        ),
    ),
    Mutant(
        name="tensors_hash_covers_the_header",
        story="the streamed writer hashes the header (with its placeholder) along with the tensor bytes",
        path="prior/artifact.py",
        function="write_streamed",
        pattern=r"digest = hashlib\.sha256\(\)",
        replacement="digest = hashlib.sha256(header)",
        tests=(f"{COLLECTOR}::test_a_streamed_artifact_gets_the_hash_of_its_bytes_in_place",),
    ),
    Mutant(
        name="validate_skips_tensor_hash",
        story="rpb validate checks the values but not tensors_sha256: a flipped bit that keeps them plausible passes",
        path="train/validate.py",
        function="validate_artifact",
        pattern=r"problems \+= file_problems\(path, art\)",
        replacement='problems += [p for p in file_problems(path, art) if not p.startswith("tensors_sha256")]',
        tests=(f"{CHECKS}::test_validate_names_each_damage[bitflip]",),
    ),
    Mutant(
        name="schema_2_prior_refused",
        story="a prior from before the hash is refused for lacking one, instead of loading with a note",
        path="prior/checks.py",
        function="metadata_problems",
        pattern=r"if digest is None and isinstance\(version, int\) and version >= 3:",
        replacement="if digest is None:",
        tests=(f"{CHECKS}::test_a_schema_2_prior_loads_with_one_note",),
    ),
    Mutant(
        name="train_reads_prior_unchecked",
        story="rpb train reads the prior with the raw reader: a NaN prior trains with exit 0",
        path="train/run.py",
        function="prepare_run",
        pattern=r"load_prior\(cfg\.prior\)",
        replacement=f"{RAW}(cfg.prior)",
        tests=(f"{CHECKS}::test_train_refuses[nan]",),
    ),
    Mutant(
        name="calibrate_reads_prior_unchecked",
        story="rpb calibrate reads the prior with the raw reader: a NaN prior gets a recommended beta",
        path="calibrate/run.py",
        function="calibrate",
        pattern=r"load_prior\(prior\)",
        replacement=f"{RAW}(prior)",
        tests=(f"{CHECKS}::test_calibrate_refuses[nan]",),
    ),
    Mutant(
        name="agreement_reads_prior_unchecked",
        story="the mechanism figures read the prior with the raw reader: a negative prior's top-k is compared",
        path="calibrate/agreement.py",
        function="training_rows_agreement",
        pattern=r"load_prior\(prior\)",
        replacement=f"{RAW}(prior)",
        tests=(f"{CHECKS}::test_calibrate_refuses[negative]",),
    ),
    Mutant(
        name="experts_reads_prior_unchecked",
        story="rpb experts reads the prior with the raw reader: NaN scores are written into its JSON",
        path="experts/run.py",
        function="run_experts",
        pattern=r"load_prior\(prior\)",
        replacement=f"{RAW}(prior)",
        tests=(f"{CHECKS}::test_experts_refuses[nan]",),
    ),
    Mutant(
        name="megatron_check_reads_metadata_only",
        story="rpb megatron-check --files reads the prior's metadata alone: a NaN prior is 'OK' before launch",
        path="integrations/megatron/config.py",
        function="file_problems",
        pattern=r"meta = load_prior\(cfg\.prior\)\.metadata",
        replacement='meta = __import__("rpb.prior.artifact", fromlist=["read_metadata"]).read_metadata(cfg.prior)',
        tests=(f"{CHECKS}::test_megatron_check_files_refuses[nan]",),
    ),
    Mutant(
        name="megatron_bridge_reads_prior_unchecked",
        story="the Megatron bridge reads the prior with the raw reader: every rank trains on a flipped bit",
        path="integrations/megatron/bridge.py",
        function="prepare_data",
        pattern=r"load_prior\(cfg\.prior\)",
        replacement=f"{RAW}(cfg.prior)",
        tests=(f"{CHECKS}::test_megatron_bridge_refuses[bitflip]",),
    ),
    Mutant(
        name="trl_prepare_reads_prior_unchecked",
        story="the TRL integration's prepare reads the prior with the raw reader: a negative prior trains",
        path="integrations/trl/sft.py",
        function="prepare",
        pattern=r"load_prior\(prior\)",
        replacement=f"{RAW}(prior)",
        tests=(f"{CHECKS}::test_trl_prepare_refuses[negative]",),
    ),
    Mutant(
        name="axolotl_plugin_reads_prior_unchecked",
        story="the axolotl plugin reads the prior with the raw reader: a NaN prior trains under axolotl",
        path="integrations/axolotl/plugin.py",
        function="RpbPlugin.load_datasets",
        pattern=r"load_prior\(run\.section\.prior\)",
        replacement=f"{RAW}(run.section.prior)",
        tests=(f"{CHECKS}::test_axolotl_plugin_refuses[nan]",),
    ),
)
