"""``rpb``: collect | validate | calibrate | experts | render | train | audit | retention | demo | experiment |
megatron-check.

Thin: parses arguments, calls the library. A problem with the input (any ``rpb.errors.RpbError``:
bad rows, a bad configuration, a prior of another run, an unsupported model, a bad argument)
prints its message and exits 2; anything else is a bug and exits 1 with its traceback; ``rpb audit`` exits 3
when the set-up contradicts what it asks.
``--debug`` prints the traceback in both cases.

Each module here registers one family of commands. Commands that live outside the core (the toy world's
``demo`` and ``experiment``) come in through the ``rpb.commands`` entry point group, so that the core never
imports them: a plugin that cannot be loaded leaves every core command working and is named, with its error,
under ``rpb --help`` and whenever a command the core does not know is asked for.
"""

from __future__ import annotations

import argparse
import sys
import traceback
from importlib.metadata import entry_points

from rpb.cli import megatron, prior, retention, training
from rpb.errors import RpbError

#: the entry point group a distribution names its command families in: ``name = "module:add_commands"``,
#: where ``add_commands(add)`` registers its subparsers as the core's modules do
PLUGIN_GROUP = "rpb.commands"

#: the commands that take key=value overrides
OVERRIDES = ("train", "audit", "megatron-check")


def _add_plugins(add) -> list[tuple[str, str]]:
    """Register every plugin's commands; ``[(plugin "name = value", its traceback)]`` for those that failed."""
    failed = []
    seen = set()  # one installed tree can be visible twice (dist-info and the source tree's egg-info)
    for ep in entry_points(group=PLUGIN_GROUP):
        if (ep.name, ep.value) in seen:
            continue
        seen.add((ep.name, ep.value))
        try:
            ep.load()(add)
        except Exception:  # a plugin's failure must not take the core commands down with it: kept and reported
            failed.append((f"{ep.name} = {ep.value}", traceback.format_exc()))
    return failed


def _last_line(trace: str) -> str:
    return trace.strip().splitlines()[-1]


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="rpb", description="Router Prior Bias: soft router anchoring for MoE post-training"
    )
    common = argparse.ArgumentParser(add_help=False)
    common.add_argument("--debug", action="store_true", help="print the traceback of every error")
    sub = p.add_subparsers(dest="command", required=True)

    def add(name: str, **kw) -> argparse.ArgumentParser:
        return sub.add_parser(name, parents=[common], **kw)

    for family in (prior, training, retention, megatron):
        family.add_commands(add)
    p.plugin_failures = _add_plugins(add)
    if p.plugin_failures:
        p.epilog = "\n".join(
            f"command plugin {name} failed to load ({_last_line(trace)}); its commands are missing"
            for name, trace in p.plugin_failures
        )
    p.commands = set(sub.choices)
    return p


def _unknown_command(parser, argv: list[str]) -> str | None:
    """The command asked for, when the core does not know it and a plugin that might have it failed."""
    asked = next((a for a in argv if not a.startswith("-")), None)
    if asked is None or asked in parser.commands or not parser.plugin_failures:
        return None
    return asked


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    parser = build_parser()
    if (asked := _unknown_command(parser, argv)) is not None:
        for name, trace in parser.plugin_failures:
            if "--debug" in argv:
                print(trace, file=sys.stderr, end="")
            print(f"rpb: command plugin {name} failed to load: {_last_line(trace)}", file=sys.stderr)
        print(f"rpb {asked}: no such command here; it may belong to the plugin(s) above", file=sys.stderr)
        return 2
    args, extra = parser.parse_known_args(argv)
    # overrides may come before or after options (key=value, never starting with "-")
    stray = [a for a in extra if a.startswith("-") or "=" not in a or args.command not in OVERRIDES]
    if stray:
        parser.error(f"unrecognized arguments: {' '.join(stray)}")
    if args.command in OVERRIDES:
        args.overrides = [*args.overrides, *extra]
    try:
        return args.func(args)
    except RpbError as e:  # the message names what is wrong and where
        if args.debug:
            traceback.print_exc()
        print(f"rpb {args.command}: {e}", file=sys.stderr)
        return 2
    except Exception:  # a bug, or a failure rpb does not know how to explain: show where it happened
        traceback.print_exc()
        print(f"rpb {args.command}: failed with the error above", file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())
