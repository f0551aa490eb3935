"""The prior's commands: collect it, validate it, render rows for it, calibrate its beta."""

from __future__ import annotations

import os
import sys

from rpb.cli.options import betas, model_options, template_kwargs_option
from rpb.errors import ArgumentError
from rpb.models import DTYPES
from rpb.prior import PRIOR_KINDS, ROUTER_TRANSFORMS


def _collect(args) -> int:
    from rpb.collect import collect

    if args.from_routes:
        art = _collect_from_routes(args)
    elif args.top_k is None:
        raise ArgumentError("--top-k is required (it must equal the model's own top-k), unless --from-routes")
    else:
        art = _collect_forward(args, collect)
    n, _, layers, experts = art.prior_qa.shape
    if os.environ.get("RANK", "0") == "0":  # under torchrun every rank returns the artifact; one says so
        kind = "" if art.kind == "probability" else f" ({art.kind} prior)"
        print(f"wrote {args.out_path}: {n} samples x 2 spans x {layers} MoE layers x {experts} experts{kind}")
    return 0


def _collect_from_routes(args):
    from rpb.collect.from_routes import collect_from_routes

    if args.prior_kind not in (None, "frequency"):
        raise ArgumentError("--from-routes collects a frequency prior (engines return no router probabilities)")
    return collect_from_routes(
        args.model,
        args.data_jsonl,
        args.from_routes,
        args.out_path,
        max_seq_len=args.max_seq_len,
        top_k=args.top_k,
        router_transform=args.router_transform,
        tokenizer_id=args.tokenizer,
        adapter=args.adapter,
        progress=not args.no_progress,
        chunk_rows=args.chunk_rows,
        chat_template_kwargs=args.chat_template_kwargs,
        fused_shared_experts=args.fused_shared_experts,
    )


def _collect_forward(args, collect):
    return collect(
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
        prior_kind=args.prior_kind or "probability",
    )


def _routes(args) -> int:
    from rpb.collect.hf_routes import write_requests, write_route_shards, write_routes

    if args.requests:
        n = write_requests(
            args.data_jsonl, args.requests, args.tokenizer or args.model, args.max_seq_len, args.chat_template_kwargs
        )
        print(f"wrote {args.requests}: {n} requests (rpb's token ids of each row, for an engine's prompt_token_ids)")
        return 0
    if not args.out:
        raise ArgumentError("rpb routes needs --out (the route file), or --requests (the engine's requests)")
    common = dict(
        batch_size=args.batch_size,
        tokenizer_id=args.tokenizer,
        adapter=args.adapter,
        dtype=args.dtype,
        chat_template_kwargs=args.chat_template_kwargs,
        probs_transform=args.with_probs,
        top_m=args.top_m,
    )
    if args.chunk_rows is not None:
        n = write_route_shards(
            args.model, args.data_jsonl, args.out, args.max_seq_len, args.chunk_rows, device=args.device, **common
        )
    elif int(os.environ.get("WORLD_SIZE", "1")) > 1:
        raise ArgumentError("rpb routes under torchrun writes shards: give --chunk-rows (rows a shard)")
    else:
        n = write_routes(args.model, args.data_jsonl, args.out, args.max_seq_len, **common)
    read_as = "the family's own transform" if args.with_probs == "family" else args.with_probs
    probs = f", with router probabilities ({read_as})" if args.with_probs else ""
    probs += f" at the top {args.top_m} experts" if args.top_m else ""
    shards = f" in shards of {args.chunk_rows} rows" if args.chunk_rows is not None else ""
    print(f"wrote {args.out}: routes of {n} rows in vLLM's layout{probs}{shards} (rpb collect --from-routes reads it)")
    return 0


def _validate(args) -> int:
    from rpb.train.validate import validate_artifact

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
        args.model,
        args.prior,
        args.data_jsonl,
        out=args.out,
        betas=args.betas,
        rows=args.rows,
        seed=args.seed,
        batch_size=args.batch_size,
        eps=args.eps,
        c=args.c,
        tokenizer=args.tokenizer,
        trust_remote_code=args.trust_remote_code,
        adapter=args.adapter,
        dtype=args.dtype,
        device=args.device,
        progress=not args.no_progress,
    )
    for beta in report["betas"]:
        m = report["displacement"]["mean"][f"{beta:g}"]["both"]
        cf = report["displacement_counterfactual"]["mean"][f"{beta:g}"]["both"]
        print(f"beta {beta:g}: displaced content tokens {m:.3f} (counterfactual {cf:.3f}), mean over MoE layers")
    print(f"recommended beta: {report['recommended_beta']:g}")
    print(f"wrote {args.out}/calibrate.json, calibrate.md and calibrate.png")
    return 0


def _render(args) -> int:
    from rpb.data.render import render_file
    from rpb.models import load_tokenizer

    n = render_file(load_tokenizer(args.tokenizer, args.trust_remote_code), args.input, args.out)
    print(f"wrote {n} rows to {args.out}")
    return 0


def add_commands(add) -> None:
    """``add(name, help=...)`` makes a subparser that takes the options every command shares."""
    c = add("collect", help="collect the frozen base model's routing prior over a JSONL file")
    c.add_argument("--model", required=True, help="base checkpoint directory or hub id")
    c.add_argument("--data-jsonl", required=True, help="training conversations, one JSON object per line")
    c.add_argument("--out-path", required=True, help="where to write the .safetensors prior")
    c.add_argument("--top-k", type=int, help="must equal the model's own top-k (required unless --from-routes)")
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
    c.add_argument(
        "--prior-kind",
        choices=PRIOR_KINDS,
        help="probability: the router's probabilities per span (the paper's prior; the default of a forward); "
        "frequency: the share of the span's tokens choosing each expert, over top-k (what an engine's routes give; "
        "the default and only kind of --from-routes)",
    )
    c.add_argument(
        "--from-routes",
        metavar="ROUTES",
        help="no forward: a frequency prior from the routes an engine returned for these rows (rpb's route file: "
        "rpb routes, or an engine's output saved with rpb.replay.routefile.save_routes; docs/collect.md)",
    )
    c.add_argument(
        "--fused-shared-experts",
        type=int,
        default=0,
        metavar="N",
        help="--from-routes: the columns after the top-k that an SGLang build returns for its fused shared "
        "experts (num_fused_shared_experts), dropped once checked (default 0: SGLang 0.5.23 and vLLM return none)",
    )
    template_kwargs_option(c)
    c.add_argument("--no-progress", action="store_true")
    c.set_defaults(func=_collect)

    o = add("routes", help="routes of an HF model over a JSONL file in vLLM's layout, or the requests for an engine")
    o.add_argument("--model", required=True, help="checkpoint directory or hub id (--requests: its tokenizer)")
    o.add_argument("--data-jsonl", required=True, help="the rows, as rpb collect reads them")
    o.add_argument("--max-seq-len", type=int, required=True, help="right-truncate each row as rpb collect does")
    o.add_argument("--out", help="where to write the route file (.safetensors)")
    o.add_argument(
        "--requests",
        metavar="JSONL",
        help="write no routes: each row's token ids, to send an engine as prompt_token_ids (no model is loaded)",
    )
    o.add_argument(
        "--with-probs",
        nargs="?",
        const="family",
        choices=["family", *ROUTER_TRANSFORMS],
        help="also store the router's probabilities at each routed expert, read under this transform (alone: the "
        "family's own; routing-kd trains against the run's, anchor.router_transform, and refuses another)",
    )
    o.add_argument(
        "--top-m",
        type=int,
        metavar="M",
        help="with --with-probs: store M experts per token and layer, the routed top-k first and then the next by "
        "probability (M = the model's experts: the whole distribution; routing-kd's bucket form reads them all)",
    )
    o.add_argument(
        "--chunk-rows",
        type=int,
        metavar="N",
        help="write --out as a directory of shards of N rows and an index: resumable after a kill (the finished "
        "shards kept in <out>.partial/), and shared out over processes under torchrun; every reader takes it",
    )
    o.add_argument("--tokenizer", help="default: --model")
    model_options(o)
    template_kwargs_option(o)
    o.set_defaults(func=_routes)

    v = add("validate", help="check a prior artifact, optionally against its data and model")
    v.add_argument("artifact")
    v.add_argument("--data-jsonl")
    v.add_argument("--expected-model")
    v.add_argument("--expected-layers", type=int)
    v.add_argument("--expected-experts", type=int)
    template_kwargs_option(v, "the chat template keyword arguments the prior must have been collected with")
    v.set_defaults(func=_validate)

    k = add("calibrate", help="before training: how far the prior bias moves the frozen base's own expert choice")
    k.add_argument("--model", required=True, help="the base the prior was collected on")
    k.add_argument("--prior", required=True, help="the prior (rpb collect)")
    k.add_argument("--data-jsonl", required=True, help="the file the prior was collected on")
    k.add_argument("--out", required=True, help="directory for calibrate.json, calibrate.md and calibrate.png")
    k.add_argument("--betas", type=betas, default=[0.1, 0.25, 0.5, 1.0, 2.0], help="comma-separated, e.g. 0.25,0.5,1")
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
    model_options(k)
    k.add_argument("--no-progress", action="store_true")
    k.set_defaults(func=_calibrate)

    r = add("render", help="turn question/answer rows into reference-form input/output rows")
    r.add_argument("--tokenizer", required=True)
    r.add_argument("--in", dest="input", required=True)
    r.add_argument("--out", required=True)
    r.add_argument("--trust-remote-code", action="store_true")
    r.set_defaults(func=_render)
