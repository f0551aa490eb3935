"""``rpb``: collect | validate | calibrate | experts | render | train | audit | retention | demo | experiment |
megatron-check.

Thin: parses arguments, calls the library. A problem with the input (any ``rpb.errors.RpbError``:
bad rows, a bad configuration, a prior of another run, an unsupported model, a bad argument)
prints its message and exits 2; anything else is a bug and exits 1 with its traceback; ``rpb audit`` exits 3
when the set-up contradicts what it asks.
``--debug`` prints the traceback in both cases.
"""

from __future__ import annotations

import argparse
import os
import sys
import traceback

from rpb.errors import RpbError
from rpb.models import DTYPES
from rpb.prior import ROUTER_TRANSFORMS


def _json_object(text: str) -> dict:
    import json

    try:
        value = json.loads(text)
    except json.JSONDecodeError as e:
        raise argparse.ArgumentTypeError(f"not JSON: {e.msg}") from None
    if not isinstance(value, dict):
        raise argparse.ArgumentTypeError(f"expected a JSON object, got {type(value).__name__}")
    return value


def _model_options(parser) -> None:
    """The options every command that runs a checkpoint over data takes the same way."""
    parser.add_argument("--batch-size", type=int, default=8)
    parser.add_argument("--adapter", help="the model_type whose router facts to use (default: the model's own)")
    parser.add_argument("--dtype", default="float32", choices=list(DTYPES))
    parser.add_argument("--device", default="auto")


def _template_kwargs_option(parser, help_text: str | None = None) -> None:
    parser.add_argument(
        "--chat-template-kwargs", type=_json_object, metavar="JSON",
        help=help_text or "the chat template's keyword arguments, e.g. '{\"enable_thinking\": true}' (recorded)",
    )  # fmt: skip


def _collect(args) -> int:
    from rpb.collect import collect

    art = collect(
        args.model,
        args.data_jsonl,
        args.out_path,
        top_k=args.top_k,
        max_seq_len=args.max_seq_len,
        router_transform=args.router_transform,
        batch_size=args.batch_size,
        dtype=args.dtype,
        trust_remote_code=args.trust_remote_code,
        tokenizer_id=args.tokenizer,
        adapter=args.adapter,
        progress=not args.no_progress,
        device=args.device,
        chunk_rows=args.chunk_rows,
        bucket=not args.no_bucket,
        chat_template_kwargs=args.chat_template_kwargs,
    )
    n, _, layers, experts = art.prior_qa.shape
    if os.environ.get("RANK", "0") == "0":  # under torchrun every rank returns the artifact; one says so
        print(f"wrote {args.out_path}: {n} samples x 2 spans x {layers} MoE layers x {experts} experts")
    return 0


def _validate(args) -> int:
    from rpb.validate import validate_artifact

    report = validate_artifact(
        args.artifact,
        data_jsonl=args.data_jsonl,
        expected_model=args.expected_model,
        expected_layers=args.expected_layers,
        expected_experts=args.expected_experts,
        expected_template_kwargs=args.chat_template_kwargs,
    )
    print(report.format(), file=sys.stdout if report.ok else sys.stderr)
    return 0 if report.ok else 1


def _calibrate(args) -> int:
    from rpb.calibrate import calibrate

    report = calibrate(
        args.model, args.prior, args.data_jsonl, out=args.out, betas=args.betas, rows=args.rows, seed=args.seed,
        batch_size=args.batch_size, eps=args.eps, c=args.c, tokenizer=args.tokenizer,
        trust_remote_code=args.trust_remote_code, adapter=args.adapter, dtype=args.dtype, device=args.device,
        progress=not args.no_progress,
    )  # fmt: skip
    for beta in report["betas"]:
        m = report["displacement"]["mean"][f"{beta:g}"]["both"]
        cf = report["displacement_counterfactual"]["mean"][f"{beta:g}"]["both"]
        print(f"beta {beta:g}: displaced content tokens {m:.3f} (counterfactual {cf:.3f}), mean over MoE layers")
    print(f"recommended beta: {report['recommended_beta']:g}")
    print(f"wrote {args.out}/calibrate.json, calibrate.md and calibrate.png")
    return 0


def _betas(text: str) -> list[float]:
    try:
        return [float(b) for b in text.split(",") if b.strip()] if text.strip() else []
    except ValueError:
        raise argparse.ArgumentTypeError(f"a comma-separated list of numbers, got {text!r}") from None


LANES_HELP = (
    "runs side by side, one process each, the usable cores shared out among them (default: one per usable "
    "core, at most 8; 1: one after another, all threads to each)"
)


def _positive_int(text: str) -> int:
    if not text.isdigit() or int(text) < 1:
        raise argparse.ArgumentTypeError(f"a whole number of at least 1, got {text!r}")
    return int(text)


def _render(args) -> int:
    from rpb.data.render import render_file
    from rpb.models import load_tokenizer

    n = render_file(load_tokenizer(args.tokenizer, args.trust_remote_code), args.input, args.out)
    print(f"wrote {n} rows to {args.out}")
    return 0


def _retention(args) -> int:
    from rpb.retention.run import run_retention

    report = run_retention(
        args.base, args.data_jsonl, args.out, post=args.post, max_rows=args.max_rows, seed=args.seed,
        resolution=args.resolution, batch_size=args.batch_size, max_seq_len=args.max_seq_len,
        tokenizer=args.tokenizer, adapter=args.adapter, dtype=args.dtype, device=args.device,
        progress=not args.no_progress, transitions=args.transitions, steps_by=args.steps_by,
        chat_template_kwargs=args.chat_template_kwargs,
    )  # fmt: skip
    m = report["mean"]
    if args.post:
        print(f"mean over {len(report['layers'])} MoE layers: TVD {m['tvd']:.4f}, JSD {m['jsd']:.4f} bits, "
              f"top-k overlap {m['topk_overlap']:.4f}, NMI {m['nmi']:.4f}")  # fmt: skip
        if args.transitions:
            print(f"transitions: NMI {m['transition_nmi']:.4f}, TVD {m['transition_tvd']:.4f}, "
                  f"row JSD {m['transition_row_jsd']:.4f} bits")  # fmt: skip
    else:
        print(f"mean utilization entropy {m['entropy_base_bits']:.4f} bits, modularity {m['modularity_base']:.4f}")
    print(f"wrote {args.out}/report.json, report.md and plots")
    return 0


def _demo(args) -> int:
    from rpb.toyworld.demo import run_demo

    return run_demo(args.out, cache_dir=args.cache_dir, progress=not args.no_progress, from_scratch=args.from_scratch,
                    lanes=args.lanes)  # fmt: skip


def _experiment(args) -> int:
    import time

    from rpb.toyworld.across import run_grid
    from rpb.toyworld.experiment import GRIDS

    started = time.perf_counter()
    out = args.out or f"rpb-experiment-{args.grid}"
    if args.ship:
        from rpb.toyworld.shipping import ship

        print(ship(GRIDS[args.grid], out, args.ship, args.cache_dir))
        return 0
    from rpb.toyworld.lanes import default_lanes

    if args.resume_from:
        from rpb.toyworld.shipping import resume_from

        print(resume_from(GRIDS[args.grid], out, args.resume_from))

    tables = run_grid(GRIDS[args.grid], out, args.cache_dir, not args.no_progress, args.keep_checkpoints,
                      lanes=args.lanes or default_lanes(), bases=args.bases)  # fmt: skip
    print(tables)
    if args.bases is None or set(args.bases) >= set(GRIDS[args.grid].bases):
        print(f"wrote {out}/tables.md and results.json ({time.perf_counter() - started:.0f} s this run)")
    return 0


def _train(args) -> int:
    if args.dry_run:
        from rpb.dryrun import dry_run

        print(dry_run(args.config, args.overrides).summary())
        return 0
    from rpb.config import load_config

    cfg = load_config(args.config, args.overrides)
    from rpb.train import run_training

    out = run_training(cfg, progress=not args.no_progress)
    print(f"saved {out}")
    return 0


def _experts(args) -> int:
    from rpb.experts.run import run_experts

    choice = run_experts(
        args.prior, args.out, measure=args.measure, threshold=args.threshold, top_n=args.top_n, span=args.span,
        model=args.model, data_jsonl=args.data_jsonl, tokenizer=args.tokenizer, shared_experts=args.shared_experts,
        non_expert_modules=args.non_expert_modules, batch_size=args.batch_size, adapter=args.adapter,
        dtype=args.dtype, device=args.device, progress=not args.no_progress,
    )  # fmt: skip
    sizes = [len(ids) for ids in choice.experts.values()]
    print(f"wrote {args.out}: {sum(sizes)} experts over {len(sizes)} MoE layers ({min(sizes)} to {max(sizes)} a layer)")
    return 0


def _audit(args) -> int:
    from rpb.monitor.run import run_audit

    report = run_audit(args.config, args.overrides, rows=args.rows, out=args.report)
    print(report.table())
    return 3 if report.contradictions else 0


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
    print(f"{args.config}: Megatron configuration OK (anchor.method={cfg.anchor.method}, "
          f"world size {cfg.world_size}, DP {cfg.data_parallel_size})")  # fmt: skip
    return 0


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="rpb", description="Router Prior Bias: soft router anchoring for MoE post-training"
    )
    common = argparse.ArgumentParser(add_help=False)
    common.add_argument("--debug", action="store_true", help="print the traceback of every error")
    sub = p.add_subparsers(dest="command", required=True)
    add = lambda name, **kw: sub.add_parser(name, parents=[common], **kw)  # noqa: E731

    c = add("collect", help="collect the frozen base model's routing prior over a JSONL file")
    c.add_argument("--model", required=True, help="base checkpoint directory or hub id")
    c.add_argument("--data-jsonl", required=True, help="training conversations, one JSON object per line")
    c.add_argument("--out-path", required=True, help="where to write the .safetensors prior")
    c.add_argument("--top-k", type=int, required=True, help="must equal the model's own top-k")
    c.add_argument("--max-seq-len", type=int, required=True, help="right-truncate to this many routed positions")
    c.add_argument("--router-transform", default="softmax", choices=ROUTER_TRANSFORMS)
    c.add_argument("--batch-size", type=int, default=8)
    c.add_argument("--dtype", default="float32", choices=list(DTYPES))
    c.add_argument("--tokenizer", help="tokenizer directory or hub id (default: --model)")
    c.add_argument(
        "--trust-remote-code", action="store_true", help="allow the tokenizer's own code (never the model's)"
    )
    c.add_argument("--adapter", help="route this model with the adapter of another model_type")
    c.add_argument("--device", default="auto", help="auto (CUDA when available), cpu, cuda, cuda:1, ...")
    c.add_argument(
        "--chunk-rows", type=int, default=256, help="rows per chunk written to <out>.partial/ (resume, shard unit)"
    )
    c.add_argument("--no-bucket", action="store_true", help="batch rows in file order, not by length")
    _template_kwargs_option(c)
    c.add_argument("--no-progress", action="store_true")
    c.set_defaults(func=_collect)

    v = add("validate", help="check a prior artifact, optionally against its data and model")
    v.add_argument("artifact")
    v.add_argument("--data-jsonl")
    v.add_argument("--expected-model")
    v.add_argument("--expected-layers", type=int)
    v.add_argument("--expected-experts", type=int)
    _template_kwargs_option(v, "the chat template keyword arguments the prior must have been collected with")
    v.set_defaults(func=_validate)

    k = add("calibrate", help="before training: how far the prior bias moves the frozen base's own expert choice")
    k.add_argument("--model", required=True, help="the base the prior was collected on")
    k.add_argument("--prior", required=True, help="the prior (rpb collect)")
    k.add_argument("--data-jsonl", required=True, help="the file the prior was collected on")
    k.add_argument("--out", required=True, help="directory for calibrate.json, calibrate.md and calibrate.png")
    k.add_argument("--betas", type=_betas, default=[0.1, 0.25, 0.5, 1.0, 2.0], help="comma-separated, e.g. 0.25,0.5,1")
    k.add_argument(
        "--rows", type=int, help="a seeded sample of this many rows (default: 256, or every row of a smaller file)"
    )
    k.add_argument("--seed", type=int, default=0, help="row sample and bootstrap seed")
    k.add_argument("--eps", type=float, default=0.05)
    k.add_argument("--c", type=float, default=5.0)
    k.add_argument("--tokenizer", help="default: --model")
    k.add_argument(
        "--trust-remote-code", action="store_true", help="allow the tokenizer's own code (never the model's)"
    )
    _model_options(k)
    k.add_argument("--no-progress", action="store_true")
    k.set_defaults(func=_calibrate)

    r = add("render", help="turn question/answer rows into reference-form input/output rows")
    r.add_argument("--tokenizer", required=True)
    r.add_argument("--in", dest="input", required=True)
    r.add_argument("--out", required=True)
    r.add_argument("--trust-remote-code", action="store_true")
    r.set_defaults(func=_render)

    t = add("train", help="post-train with an anchor (rpb, lbl, router-l2, kl-to-base, ...)")
    t.add_argument("--config", help="YAML run configuration")
    t.add_argument("overrides", nargs="*", metavar="key.sub=value", help="dotted overrides, e.g. anchor.beta=0.5")
    t.add_argument("--dry-run", action="store_true",
                   help="check the configuration, the prior, every row and the prior against the run without loading "
                   "the model; list every problem and stop")  # fmt: skip
    t.add_argument("--no-progress", action="store_true")
    t.set_defaults(func=_train)

    e = add("experts", help="choose each MoE layer's experts from the task's routing (ESFT's gate or token measure)")
    e.add_argument("--prior", required=True, help="the task's prior (rpb collect)")
    e.add_argument("--out", required=True, help="the ESFT-style expert config to write (JSON)")
    e.add_argument("--measure", default="gate", choices=["gate", "token"],
                   help="gate: average gate score (the prior); token: token-selection ratio (a pass of "
                   "the base)")  # fmt: skip
    how = e.add_mutually_exclusive_group()
    how.add_argument("--threshold", type=float, help="each layer's experts up to this cumulative share (default 0.2)")
    how.add_argument("--top-n", type=int, help="each layer's n highest experts")
    e.add_argument("--span", default="all", choices=["all", "question", "answer"], help="which tokens count")
    e.add_argument("--model", help="the prior's base (measure token; with gate, for the check that the router "
                   "ever selects the chosen experts)")  # fmt: skip
    e.add_argument("--data-jsonl", help="the prior's data file (as --model)")
    e.add_argument("--tokenizer", help="default: --model")
    e.add_argument("--shared-experts", action="store_true", help="the config says: train the shared experts too")
    e.add_argument("--non-expert-modules", action="store_true",
                   help="the config says: train attention, embeddings and the rest too")  # fmt: skip
    _model_options(e)
    e.add_argument("--no-progress", action="store_true")
    e.set_defaults(func=_experts)

    a = add("audit", help="two training steps of an rpb train config: what they really do to the routers")
    a.add_argument("--config", required=True, help="the rpb train YAML")
    a.add_argument("overrides", nargs="*", metavar="key.sub=value", help="dotted overrides, as for rpb train")
    a.add_argument("--rows", type=int, default=4, help="rows of the data file the two steps train on")
    a.add_argument("--report", help="also write the report as JSON here (nothing else is written)")
    a.set_defaults(func=_audit)

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
    _model_options(r)
    r.add_argument("--transitions", action="store_true",
                   help="also the directed expert transitions of answer tokens and their communities")  # fmt: skip
    r.add_argument("--steps-by", metavar="REGEX",
                   help="also step-level transitions, answers cut where REGEX matches (e.g. '\\n')")  # fmt: skip
    r.add_argument("--no-progress", action="store_true")
    _template_kwargs_option(r)
    r.set_defaults(func=_retention)

    m = add("megatron-check", help="validate a Megatron-Bridge run configuration (no GPU, no Bridge)")
    m.add_argument("config", help="e.g. examples/moonlight/config.yaml")
    m.add_argument("overrides", nargs="*", metavar="key.sub=value", help="dotted overrides, e.g. train.seed=43")
    m.add_argument("--files", action="store_true", help="also check the checkpoint, data and prior files")
    m.set_defaults(func=_megatron_check)

    d = add("demo", help="the paper's study in miniature: toy base -> prior -> sft, lbl, rpb -> table")
    d.add_argument("--out", default="rpb-demo")
    d.add_argument("--cache-dir", help="where the base model is cached (default: $RPB_CACHE or ~/.cache/rpb)")
    d.add_argument("--from-scratch", action="store_true",
                   help="pretrain the base here instead of taking the repository's shipped one")  # fmt: skip
    d.add_argument("--no-progress", action="store_true")
    d.add_argument("--lanes", type=_positive_int, help=LANES_HELP)
    d.set_defaults(func=_demo)

    x = add("experiment", help="the toy-world study: every anchor x seeds x post-training sets, tables")
    x.add_argument(
        "--grid", default="small", choices=["headline", "full", "small", "beta", "cot"],
        help="headline: sft, lbl, rpb, rpb at the calibrated beta x 5 seeds x 2 sets x 3 bases; full: every method "
        "x 3 seeds x 2 sets x 3 bases; beta: rpb over beta, likewise; small: 4 methods x 1 seed on the math set; "
        "cot: sft, lbl, rpb and the four within-* controls x 3 seeds on the long-trace set, base 0, with "
        "transition retention",
    )  # fmt: skip
    x.add_argument("--out", help="output directory (default: rpb-experiment-<grid>); rerun to resume")
    x.add_argument("--cache-dir", help="where the base model is cached (default: $RPB_CACHE or ~/.cache/rpb)")
    x.add_argument("--keep-checkpoints", action="store_true", help="keep every trained model (about 20 MB each)")
    x.add_argument("--no-progress", action="store_true")
    x.add_argument("--lanes", type=_positive_int, help=LANES_HELP)
    x.add_argument("--bases", type=int, nargs="+", metavar="SEED",
                   help="run only these of the grid's bases (this machine's share of it) and write no report; "
                   "`--ship DIR` from each machine's --out brings the bases together")  # fmt: skip
    shipped = x.add_mutually_exclusive_group()
    shipped.add_argument("--ship", metavar="DIR",
                         help="train nothing: copy each base of --out whose runs are all finished to DIR/base<seed>/ "
                         "(its cells, set-up, selection, scores, calibration, facts), and the finished runs of a base "
                         "still running to DIR/unfinished/base<seed>/; then write the report over the whole bases "
                         "shipped in DIR (docs/results/<grid> in this repository)")  # fmt: skip
    shipped.add_argument("--resume-from", metavar="DIR",
                         help="first put the runs shipped in DIR (docs/results/<grid>: its bases and unfinished/) "
                         "into --out, so that they are read back instead of run again; then run the rest")  # fmt: skip
    x.set_defaults(func=_experiment)
    return p


#: the commands that take key=value overrides
OVERRIDES = ("train", "audit", "megatron-check")


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
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
