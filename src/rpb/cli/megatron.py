"""``rpb megatron-check``: validate a Megatron-Bridge run configuration without a GPU or the Bridge."""

from __future__ import annotations


def _megatron_check(args) -> int:
    from rpb.integrations.megatron.config import load_megatron_config
    from rpb.integrations.megatron.versions import describe, installed_versions, version_warnings

    found = installed_versions()
    print(f"installed: {describe(found)}")
    for warning in version_warnings(found):
        print(f"warning: {warning} (docs/megatron.md lists the tested lines)")
    cfg = load_megatron_config(args.config, args.overrides, check_files=args.files)
    for note in cfg.notes:
        print(f"note (departs from the paper): {note}")
    print(
        f"{args.config}: Megatron configuration OK (anchor.method={cfg.anchor.method}, "
        f"world size {cfg.world_size}, DP {cfg.data_parallel_size})"
    )
    return 0


def add_commands(add) -> None:
    """``add(name, help=...)`` makes a subparser that takes the options every command shares."""
    m = add("megatron-check", help="validate a Megatron-Bridge run configuration (no GPU, no Bridge)")
    m.add_argument("config", help="e.g. examples/moonlight/config.yaml")
    m.add_argument("overrides", nargs="*", metavar="key.sub=value", help="dotted overrides, e.g. train.seed=43")
    m.add_argument("--files", action="store_true", help="also check the checkpoint, data and prior files")
    m.set_defaults(func=_megatron_check)
