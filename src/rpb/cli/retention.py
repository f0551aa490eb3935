"""``rpb retention``: how much of the base routing a post-trained model kept."""

from __future__ import annotations

from rpb.cli.options import model_options, positive_int, template_kwargs_option
from rpb.errors import ArgumentError

#: the options that belong to ``--revert-routers`` alone
REVERT_ONLY = ("domain", "generate", "reverse", "shared_expert_gates", "max_new_tokens")


def _run_options(args) -> dict:
    """What both modes take the same way: the rows, the model's loading and the template."""
    names = ("max_rows", "seed", "batch_size", "max_seq_len", "tokenizer", "adapter", "dtype", "device")
    return {k: getattr(args, k) for k in names} | {
        "progress": not args.no_progress,
        "chat_template_kwargs": args.chat_template_kwargs,
    }


def _revert(args) -> int:
    from rpb.retention.revert_run import parse_domains, run_revert

    if not args.post:
        raise ArgumentError("--revert-routers needs --post (the model whose routers are put back)")
    report = run_revert(
        args.base,
        args.post,
        parse_domains(args.domain or []),
        args.out,
        data_jsonl=args.data_jsonl,
        reverse=args.reverse,
        generate=args.generate,
        max_new_tokens=args.max_new_tokens,
        shared_gates=args.shared_expert_gates,
        **_run_options(args),
    )
    for name, e in report["sets"].items():
        if "delta_nll" not in e:
            continue
        d, post, back = e["delta_nll"], e["variants"]["post"], e["variants"]["post+base routers"]
        trained = " (trained)" if name == report["training_domain"] else ""
        print(
            f"{name}{trained}: answer NLL post {post['nll']:.4f}, reverted {back['nll']:.4f} "
            f"(Δ {d['estimate']:+.4f} [{d['ci'][0]:+.4f}, {d['ci'][1]:+.4f}]), "
            f"base {e['variants']['base']['nll']:.4f}; "
            f"top-k overlap to the base {post['topk_overlap']['all']:.3f} -> {back['topk_overlap']['all']:.3f}"
        )
    print(f"wrote {args.out}/report.json, report.md and revert.png")
    return 0


def _retention(args) -> int:
    from rpb.retention.run import run_retention

    if args.revert_routers:
        return _revert(args)
    given = [f"--{k.replace('_', '-')}" for k in REVERT_ONLY if getattr(args, k) not in (None, False)]
    if given:
        raise ArgumentError(f"{', '.join(given)}: only with --revert-routers")

    report = run_retention(
        args.base,
        args.data_jsonl,
        args.out,
        post=args.post,
        resolution=args.resolution,
        transitions=args.transitions,
        steps_by=args.steps_by,
        **_run_options(args),
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
    v = r.add_argument_group("the revert test (docs/retention.md): does the routing drift matter?")
    v.add_argument(
        "--revert-routers",
        action="store_true",
        help="run the post model with the base's routers put back (weight, router bias, expert-correction bias) "
        "beside the post model and the base on each --domain: answer NLL, top-k overlap to the base; report.json, "
        "report.md, revert.png (--data-jsonl: the routing data, whose overlap shows the routing went back)",
    )
    v.add_argument(
        "--domain",
        action="append",
        metavar="NAME=PATH",
        help="a JSONL set whose NLL is measured; repeat it; the first is the training domain",
    )
    v.add_argument("--generate", action="store_true", help="also exact match, by greedy decoding from each prompt")
    v.add_argument(
        "--max-new-tokens",
        type=positive_int,
        help="greedy decoding's budget (default: the domain's longest answer and its turn end)",
    )
    v.add_argument("--reverse", action="store_true", help="also the base with the post model's routers")
    v.add_argument(
        "--shared-expert-gates",
        action="store_true",
        help="put the MoE blocks' shared-expert gates back too (Qwen2-MoE, Qwen3.5-MoE; default: left alone)",
    )
    r.add_argument("--no-progress", action="store_true")
    template_kwargs_option(r)
    r.set_defaults(func=_retention)
