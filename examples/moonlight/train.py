"""Entry point: Moonlight-16B-A3B + an anchor (RPB by default) on Megatron-Bridge.

    torchrun --nnodes=16 --nproc-per-node=8 ... examples/moonlight/train.py \
        --config examples/moonlight/config.yaml [key.sub=value ...]

``--dry-run`` validates the configuration (and, with ``--files``, the prior and data files)
and stops; it needs neither GPUs nor Megatron-Bridge, which is imported only to train.
"""

from __future__ import annotations

import argparse
import sys


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--config", required=True, help="examples/moonlight/config.yaml or a copy of it")
    parser.add_argument("overrides", nargs="*", metavar="key.sub=value")
    parser.add_argument("--dry-run", action="store_true", help="validate the configuration and stop")
    parser.add_argument("--files", action="store_true", help="with --dry-run: also check the prior and data files")
    args = parser.parse_args(argv)

    from rpb.errors import ConfigError
    from rpb.integrations.megatron.config import load_megatron_config

    try:
        cfg = load_megatron_config(args.config, args.overrides, check_files=args.files or not args.dry_run)
    except ConfigError as e:
        print(e, file=sys.stderr)
        return 2
    for note in cfg.notes:
        print(f"note: {note}", file=sys.stderr)
    from rpb.integrations.megatron.versions import describe, installed_versions, version_warnings

    found = installed_versions()  # package metadata: nothing of Bridge is imported
    print(f"installed: {describe(found)}", file=sys.stderr)
    for warning in version_warnings(found):
        print(f"warning: {warning} (docs/megatron.md lists the tested lines)", file=sys.stderr)
    if args.dry_run:
        print(f"{args.config}: configuration OK")
        return 0

    from rpb.integrations.megatron.bridge import run_training  # imports megatron.bridge

    run_training(cfg)
    return 0


if __name__ == "__main__":
    sys.exit(main())
