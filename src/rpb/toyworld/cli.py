"""The toy world's commands, ``rpb demo`` and ``rpb experiment``, registered with the core command line
through the ``rpb.commands`` entry point (pyproject.toml): the core never imports the toy world."""

from __future__ import annotations

import argparse
import time

from rpb.cli.options import LANES_HELP, positive_int


def _demo(args) -> int:
    from rpb.toyworld.demo import run_demo

    return run_demo(
        args.out,
        cache_dir=args.cache_dir,
        progress=not args.no_progress,
        from_scratch=args.from_scratch,
        lanes=args.lanes,
    )


def _experiment(args) -> int:
    from rpb.toyworld.grids import find
    from rpb.toyworld.study.across import run_grid
    from rpb.toyworld.study.lanes import default_lanes
    from rpb.toyworld.study.shipping import resume_from, ship

    started = time.perf_counter()
    grid = find(args.grid)
    out = args.out or f"rpb-experiment-{grid.name}"
    if args.ship:
        print(ship(grid, out, args.ship, args.cache_dir))
        return 0
    if args.resume_from:
        print(resume_from(grid, out, args.resume_from))
    tables = run_grid(
        grid,
        out,
        args.cache_dir,
        not args.no_progress,
        args.keep_checkpoints,
        lanes=args.lanes or default_lanes(),
        bases=args.bases,
    )
    print(tables)
    if args.bases is None or set(args.bases) >= set(grid.bases):
        print(f"wrote {out}/tables.md and results.json ({time.perf_counter() - started:.0f} s this run)")
    return 0


class _GridsListed(argparse.HelpFormatter):
    """``rpb experiment --help`` lists the shipped grids; importing them loads the whole toy world (seconds), so
    they are listed when the help is printed, not whenever the command line is built: ``rpb collect`` and every
    other core command start without them."""

    def _get_help_string(self, action):
        if action.dest != "grid":
            return action.help
        from rpb.toyworld.grids import grids

        return f"{action.help}; the shipped grids: " + "; ".join(f"{g.name}: {g.about}" for g in grids().values())


def add_commands(add) -> None:
    """``add(name, help=...)`` makes a subparser of ``rpb`` that takes the options every command shares."""
    from rpb.toyworld.grids import DEFAULT

    d = add("demo", help="the paper's study in miniature: toy base -> prior -> sft, lbl, rpb -> table")
    d.add_argument("--out", default="rpb-demo")
    d.add_argument("--cache-dir", help="where the base model is cached (default: $RPB_CACHE or ~/.cache/rpb)")
    d.add_argument(
        "--from-scratch",
        action="store_true",
        help="pretrain the base here instead of taking the repository's shipped one",
    )
    d.add_argument("--no-progress", action="store_true")
    d.add_argument("--lanes", type=positive_int, help=LANES_HELP)
    d.set_defaults(func=_demo)

    x = add(
        "experiment",
        help="the toy-world study: every anchor x seeds x post-training sets, tables",
        formatter_class=_GridsListed,
    )
    x.add_argument(
        "--grid",
        default=DEFAULT,
        metavar="GRID",
        help="a grid of rpb.toyworld.grids by name, or module:ATTR for a grid of one's own (any importable module's "
        "grid ATTR; docs/toyworld.md)",
    )
    x.add_argument("--out", help="output directory (default: rpb-experiment-<grid>); rerun to resume")
    x.add_argument("--cache-dir", help="where the base model is cached (default: $RPB_CACHE or ~/.cache/rpb)")
    x.add_argument("--keep-checkpoints", action="store_true", help="keep every trained model (about 20 MB each)")
    x.add_argument("--no-progress", action="store_true")
    x.add_argument("--lanes", type=positive_int, help=LANES_HELP)
    x.add_argument(
        "--bases",
        type=int,
        nargs="+",
        metavar="SEED",
        help="run only these of the grid's bases (this machine's share of it) and write no report; "
        "`--ship DIR` from each machine's --out brings the bases together",
    )
    shipped = x.add_mutually_exclusive_group()
    shipped.add_argument(
        "--ship",
        metavar="DIR",
        help="train nothing: copy each base of --out whose runs are all finished to DIR/base<seed>/ "
        "(its cells, set-up, selection, scores, calibration, facts), and the finished runs of a base "
        "still running to DIR/unfinished/base<seed>/; then write the report over the whole bases "
        "shipped in DIR (docs/results/<grid> in this repository)",
    )
    shipped.add_argument(
        "--resume-from",
        metavar="DIR",
        help="first put the runs shipped in DIR (docs/results/<grid>: its bases and unfinished/) "
        "into --out, so that they are read back instead of run again; then run the rest",
    )
    x.set_defaults(func=_experiment)
