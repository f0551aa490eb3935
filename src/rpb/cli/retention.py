"""``rpb retention``: how much of the base routing a post-trained model kept."""

from __future__ import annotations

from rpb.cli.options import model_options, template_kwargs_option


def _retention(args) -> int:
    from rpb.retention.run import run_retention

    report = run_retention(
        args.base,
        args.data_jsonl,
        args.out,
        post=args.post,
        max_rows=args.max_rows,
        seed=args.seed,
        resolution=args.resolution,
        batch_size=args.batch_size,
        max_seq_len=args.max_seq_len,
        tokenizer=args.tokenizer,
        adapter=args.adapter,
        dtype=args.dtype,
        device=args.device,
        progress=not args.no_progress,
        transitions=args.transitions,
        steps_by=args.steps_by,
        chat_template_kwargs=args.chat_template_kwargs,
    )
    m = report["mean"]
    if args.post:
        print(
            f"mean over {len(report['layers'])} MoE layers: TVD {m['tvd']:.4f}, JSD {m['jsd']:.4f} bits, "
            f"top-k overlap {m['topk_overlap']:.4f}, NMI {m['nmi']:.4f}"
        )
        if args.transitions:
            print(
                f"transitions: NMI {m['transition_nmi']:.4f}, TVD {m['transition_tvd']:.4f}, "
                f"row JSD {m['transition_row_jsd']:.4f} bits"
            )
    else:
        print(f"mean utilization entropy {m['entropy_base_bits']:.4f} bits, modularity {m['modularity_base']:.4f}")
    print(f"wrote {args.out}/report.json, report.md and plots")
    return 0


def add_commands(add) -> None:
    """``add(name, help=...)`` makes a subparser that takes the options every command shares."""
    r = add("retention", help="how much of the base routing a post-trained model kept (bias-free)")
    r.add_argument("--base", required=True, help="base checkpoint")
    r.add_argument("--post", help="post-trained checkpoint (omit to describe the base alone)")
    r.add_argument("--data-jsonl", required=True)
    r.add_argument("--out", required=True, help="directory for report.json, report.md and the PNGs")
    r.add_argument("--max-rows", type=int, help="a seeded sample of this many rows (default: all)")
    r.add_argument("--seed", type=int, default=0, help="row sample and Louvain seed")
    r.add_argument("--resolution", type=float, default=1.0, help="Louvain resolution")
    r.add_argument("--max-seq-len", type=int, default=2048)
    r.add_argument("--tokenizer", help="default: --base")
    model_options(r)
    r.add_argument(
        "--transitions",
        action="store_true",
        help="also the directed expert transitions of answer tokens and their communities",
    )
    r.add_argument(
        "--steps-by", metavar="REGEX", help="also step-level transitions, answers cut where REGEX matches (e.g. '\\n')"
    )
    r.add_argument("--no-progress", action="store_true")
    template_kwargs_option(r)
    r.set_defaults(func=_retention)
