"""The training commands: train (or check a run with --dry-run), choose experts, audit two steps."""

from __future__ import annotations

from rpb.cli.options import model_options


def _train(args) -> int:
    if args.dry_run:
        from rpb.train.dryrun import dry_run

        print(dry_run(args.config, args.overrides).summary())
        return 0
    from rpb.train.config import load_config

    cfg = load_config(args.config, args.overrides)
    from rpb.train.run import run_training

    out = run_training(cfg, progress=not args.no_progress)
    print(f"saved {out}")
    return 0


def _experts(args) -> int:
    from rpb.experts.run import run_experts

    choice = run_experts(
        args.prior,
        args.out,
        measure=args.measure,
        threshold=args.threshold,
        top_n=args.top_n,
        span=args.span,
        model=args.model,
        data_jsonl=args.data_jsonl,
        tokenizer=args.tokenizer,
        shared_experts=args.shared_experts,
        non_expert_modules=args.non_expert_modules,
        batch_size=args.batch_size,
        adapter=args.adapter,
        dtype=args.dtype,
        device=args.device,
        progress=not args.no_progress,
    )
    sizes = [len(ids) for ids in choice.experts.values()]
    print(f"wrote {args.out}: {sum(sizes)} experts over {len(sizes)} MoE layers ({min(sizes)} to {max(sizes)} a layer)")
    return 0


def _audit(args) -> int:
    from rpb.train.audit import run_audit

    report = run_audit(args.config, args.overrides, rows=args.rows, out=args.report)
    print(report.table())
    return 3 if report.contradictions else 0


def add_commands(add) -> None:
    """``add(name, help=...)`` makes a subparser that takes the options every command shares."""
    t = add("train", help="post-train with an anchor (rpb, lbl, router-l2, kl-to-base, ...)")
    t.add_argument("--config", help="YAML run configuration")
    t.add_argument("overrides", nargs="*", metavar="key.sub=value", help="dotted overrides, e.g. anchor.beta=0.5")
    t.add_argument(
        "--dry-run",
        action="store_true",
        help="check the configuration, the prior, every row and the prior against the run without loading "
        "the model; list every problem and stop",
    )
    t.add_argument("--no-progress", action="store_true")
    t.set_defaults(func=_train)

    e = add("experts", help="choose each MoE layer's experts from the task's routing (ESFT's gate or token measure)")
    e.add_argument("--prior", required=True, help="the task's prior (rpb collect)")
    e.add_argument("--out", required=True, help="the ESFT-style expert config to write (JSON)")
    e.add_argument(
        "--measure",
        default="gate",
        choices=["gate", "token"],
        help="gate: average gate score (the prior); token: token-selection ratio (a pass of the base)",
    )
    how = e.add_mutually_exclusive_group()
    how.add_argument("--threshold", type=float, help="each layer's experts up to this cumulative share (default 0.2)")
    how.add_argument("--top-n", type=int, help="each layer's n highest experts")
    e.add_argument("--span", default="all", choices=["all", "question", "answer"], help="which tokens count")
    e.add_argument(
        "--model",
        help="the prior's base (measure token; with gate, for the check that the router ever selects the chosen "
        "experts)",
    )
    e.add_argument("--data-jsonl", help="the prior's data file (as --model)")
    e.add_argument("--tokenizer", help="default: --model")
    e.add_argument("--shared-experts", action="store_true", help="the config says: train the shared experts too")
    e.add_argument(
        "--non-expert-modules",
        action="store_true",
        help="the config says: train attention, embeddings and the rest too",
    )
    model_options(e)
    e.add_argument("--no-progress", action="store_true")
    e.set_defaults(func=_experts)

    a = add("audit", help="two training steps of an rpb train config: what they really do to the routers")
    a.add_argument("--config", required=True, help="the rpb train YAML")
    a.add_argument("overrides", nargs="*", metavar="key.sub=value", help="dotted overrides, as for rpb train")
    a.add_argument("--rows", type=int, default=4, help="rows of the data file the two steps train on")
    a.add_argument("--report", help="also write the report as JSON here (nothing else is written)")
    a.set_defaults(func=_audit)
