"""Training-step overhead of every anchor method against plain SFT, on a Moonlight-shaped MoE.

An anchor hooks every router; the prior-based methods re-select the top-k per token and
the loss-based ones add one term per MoE layer. Neither should cost much next to the
experts themselves, which is what this benchmark checks: it builds one Moonlight-shaped
(DeepSeek-V3) MoE, gives every method a deep copy of the same initial weights and its own
fused AdamW, and times full training steps on the same synthetic batches::

    with handle.step(sample_BT, span_BT, attention_mask_BT):
        loss = model(**batch).loss + handle.loss()
        loss.backward()
    optimizer.step(); optimizer.zero_grad()

Default shape (Moonlight-16B-A3B's layout, scaled down so that the experts dominate):

* hidden 256, 4 decoder layers, the first dense (``first_k_dense_replace=1``), 3 MoE layers;
* 64 routed experts, top-6, sigmoid router with expert-correction bias, 2 shared experts,
  ``moe_intermediate_size`` 256 (Moonlight: 1408 at hidden 2048; relatively wider here so
  that expert matmuls, not per-token bookkeeping, set the step time);
* the dense layer's ``intermediate_size`` 1024 (4 x hidden). Moonlight's dense layer is as
  wide as its active experts (11264 = 1408 * 8), but it is 1 of 27 layers there and would
  be 1 of 4 here, overstating the non-expert share of the step;
* MLA attention, 4 heads (kv_lora_rank 64, qk 32 + 16 rope, v 32);
* vocabulary 1024, so the LM head is a small share of the step.

About 41 M parameters, 38 M of them in routed experts; by the estimate printed at start-up
the experts take three quarters of the forward's matmul multiply-adds (routed 56 %, shared
19 %). A step over the default batch (8 x 128 positions, 88 % of them unpadded) takes about
0.35 s on 2 idle CPU cores. Memory: every method keeps its own model, gradients and AdamW state
(about 0.5 GB each at the default shape, so about 6 GB for all 11 methods).

The prior ``pi`` [N, 2, L, E] is a softmax of random logits; within-* use a seeded
permutation inside 8 fixed communities of 8 experts per layer, global-hard one over all
experts (``rpb.anchors.controls.layer_permutations``). Batches: each row is one sample (its row
of the prior) laid out as chat turns -- structural header tokens, question content, header,
answer content, end token -- right-padded to a random length; labels are the answer tokens.

Before timing, one untimed forward per method checks that its anchor is engaged (changed
selections for prior methods, a differentiable term for loss methods, a frozen router
for router-freeze). After ``--warmup`` rounds, ``--steps`` rounds are timed; a round runs
one step of every method, starting at a rotating method, all on the same batch. Per
method the median step time is taken; the ratio is median(method) / median(sft). The
"paired" column is the median over rounds of the same-round ratio, a cross-check that is
less sensitive to slow drifts of the machine. ``--beta 0`` runs the soft methods' whole
anchor path while keeping the native selection: it separates the cost of the hook from
that of the changed routing (a different load per expert in the expert matmuls).

Every method is timed but routing-kd and output-kd: their term reads the base's routing (or next-token
distribution) from a forward of the base on every batch, which this loop does not run. Asked for by name, they
are refused; benchmarks/teacher_overhead.py times that forward through ``rpb train``, for routing-kd.

Targets: rpb <= 1.03; kl-to-base <= 1.15 and logit-l2 <= 1.15 (the others are reported
only). The last line printed is one JSON object: method -> ratio, plus "_shape",
"_median_ms" and "_targets". The exit status is 0 whether the targets hold or not.

``--smoke`` runs every method once on a tiny shape (2 layers, 16 experts top-2, hidden 32, one batch of
2 x 48 positions, one timed step, no warm-up) and judges no target: a check that the script runs, not a
measurement.

Run: .venv/bin/python benchmarks/train_overhead.py [--steps 30 --warmup 3 --threads 2 --methods sft,rpb ...]
     [--smoke]
"""

from __future__ import annotations

import argparse
import copy
import json
import statistics
import time

import torch

from rpb.anchors import METHODS, AnchorConfig, install_anchor
from rpb.anchors.controls import layer_permutations
from rpb.prior import NUM_SPANS, STRUCTURAL
from rpb.testing.models import build_tiny_model

#: Moonlight's attention layout at a small width (as in collect_throughput.py).
MLA = dict(num_attention_heads=4, num_key_value_heads=4, kv_lora_rank=64, qk_nope_head_dim=32, qk_rope_head_dim=16)
MLA["v_head_dim"] = 32
TARGETS = {"rpb": 1.03, "kl-to-base": 1.15, "logit-l2": 1.15}
#: the methods whose term needs the base's forward on every batch (routing-kd, output-kd): not timed here
READ_THE_BASE = tuple(name for name, method in METHODS.items() if method.teacher is not None)
#: --smoke: the tiny shape, one timed step (an option given explicitly still wins)
SMOKE = dict(steps=1, warmup=0, hidden_size=32, moe_intermediate_size=32, num_layers=2, experts=16, top_k=2,
             shared_experts=1, vocab_size=128, batch_size=2, seq_len=48, batches=1, samples=8)  # fmt: skip
SPAN_Q, SPAN_A = 0, 1
COMMUNITY_SIZE = 8


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--steps", type=int, default=30, help="timed steps per method (one round = one step of each)")
    p.add_argument("--warmup", type=int, default=3, help="untimed rounds first")
    p.add_argument("--threads", type=int, default=None, help="torch.set_num_threads (default: as is)")
    p.add_argument(
        "--methods",
        nargs="+",
        default=[name for name in METHODS if name not in READ_THE_BASE],
        help="methods to time, space- or comma-separated (sft, the baseline, is always added; "
        f"default: all but {' and '.join(READ_THE_BASE)})",
    )
    p.add_argument("--hidden-size", type=int, default=256)
    p.add_argument("--moe-intermediate-size", type=int, default=256)
    p.add_argument("--intermediate-size", type=int, default=None, help="the dense layer's (default: 4 x hidden)")
    p.add_argument("--num-layers", type=int, default=4, help="decoder layers, the first one dense")
    p.add_argument("--experts", type=int, default=64, help="routed experts")
    p.add_argument("--top-k", type=int, default=6)
    p.add_argument("--shared-experts", type=int, default=2)
    p.add_argument("--vocab-size", type=int, default=1024)
    p.add_argument("--batch-size", type=int, default=8)
    p.add_argument("--seq-len", type=int, default=128, help="padded length of every batch")
    p.add_argument("--batches", type=int, default=8, help="distinct synthetic batches, cycled over rounds")
    p.add_argument("--samples", type=int, default=256, help="rows N of the prior pi [N, 2, L, E]")
    p.add_argument("--lambda", dest="lambda_", type=float, default=0.01, help="router-l2, kl-to-base, logit-l2")
    p.add_argument("--lbl-coef", type=float, default=0.001)
    p.add_argument(
        "--beta",
        type=float,
        default=1.0,
        help="bias scale of the soft methods; 0 keeps the native selection but runs the whole anchor path",
    )
    p.add_argument("--lr", type=float, default=1e-5)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--smoke", action="store_true", help="a tiny shape, one step, no target judged: does it run?")
    args = p.parse_args(argv)
    if args.smoke:  # again, on the tiny shape's defaults: an option given explicitly still wins
        p.set_defaults(**SMOKE)
        args = p.parse_args(argv)
    names = [n for item in args.methods for n in item.split(",") if n]
    unknown = [n for n in names if n not in METHODS]
    if unknown:
        p.error(f"unknown method(s) {', '.join(unknown)}; choose from {', '.join(METHODS)}")
    teachers = [n for n in names if n in READ_THE_BASE]
    if teachers:
        p.error(
            f"{', '.join(teachers)}: the term reads the base's forward on every batch, which this loop does not "
            "run; benchmarks/teacher_overhead.py times that forward (routing-kd's, through rpb train)"
        )
    args.methods = ["sft", *dict.fromkeys(n for n in names if n != "sft")]
    if args.seq_len < 16 or args.steps < 1 or args.warmup < 0:
        p.error("need --seq-len >= 16, --steps >= 1 and --warmup >= 0")
    return args


# ---- model, prior, batches -------------------------------------------------------


def build_model(args):
    shape = dict(
        hidden_size=args.hidden_size,
        intermediate_size=args.intermediate_size or 4 * args.hidden_size,
        moe_intermediate_size=args.moe_intermediate_size,
        num_hidden_layers=args.num_layers,
        first_k_dense_replace=1,
        n_routed_experts=args.experts,
        num_experts_per_tok=args.top_k,
        n_shared_experts=args.shared_experts,
        **MLA,
    )
    model = build_tiny_model("moonlight", args.vocab_size, args.seed, **shape)
    return model.train()


def matmul_shares(config, seq_len: int) -> dict[str, float]:
    """Share of the forward's matmul multiply-adds per token: routed experts, shared experts, rest."""
    H, heads = config.hidden_size, config.num_attention_heads
    qk = config.qk_nope_head_dim + config.qk_rope_head_dim
    attention = H * heads * qk + H * (config.kv_lora_rank + config.qk_rope_head_dim)
    attention += config.kv_lora_rank * heads * (config.qk_nope_head_dim + config.v_head_dim)
    attention += heads * config.v_head_dim * H + (seq_len / 2) * heads * (qk + config.v_head_dim)
    moe_layers = config.num_hidden_layers - config.first_k_dense_replace
    routed = moe_layers * config.num_experts_per_tok * 3 * H * config.moe_intermediate_size
    shared = moe_layers * 3 * H * config.moe_intermediate_size * config.n_shared_experts
    rest = config.num_hidden_layers * attention + moe_layers * H * config.n_routed_experts
    rest += config.first_k_dense_replace * 3 * H * config.intermediate_size + H * config.vocab_size
    total = routed + shared + rest
    return {"routed": routed / total, "shared": shared / total, "rest": rest / total}


def random_prior(args, num_moe_layers: int) -> torch.Tensor:
    gen = torch.Generator().manual_seed(args.seed + 2)
    logits = 2.0 * torch.randn(args.samples, NUM_SPANS, num_moe_layers, args.experts, generator=gen)
    return torch.softmax(logits, dim=-1)


def permutations(args, method: str, num_moe_layers: int) -> torch.Tensor | None:
    shuffle = METHODS[method].shuffle
    if shuffle is None:
        return None
    if shuffle == "global":
        return layer_permutations(None, args.experts, args.seed, "global", num_layers=num_moe_layers)
    labels_LE = (torch.arange(args.experts) // COMMUNITY_SIZE).expand(num_moe_layers, -1)
    return layer_permutations(labels_LE, args.experts, args.seed, "within")


def synthetic_batch(args, gen: torch.Generator) -> tuple[dict, dict]:
    """``(model kwargs, anchor context)`` for one batch of chat-shaped rows, right-padded."""
    B, T = args.batch_size, args.seq_len

    def randint(lo: int, hi: int) -> int:
        return int(torch.randint(lo, hi + 1, (), generator=gen))

    span_BT = torch.full((B, T), STRUCTURAL, dtype=torch.int64)
    mask_BT = torch.zeros(B, T, dtype=torch.int64)
    for b in range(B):
        length = T if b == 0 else randint(3 * T // 4, T)  # row 0 sets the padded length
        pos = 0
        while pos < length:
            pos += 3  # role header: structural
            for span, lo, hi in ((SPAN_Q, 8, 24), (SPAN_A, 12, 40)):
                n = max(0, min(randint(lo, hi), length - pos))
                span_BT[b, pos : pos + n] = span
                pos += n + 2  # the content, then an end-of-turn / next header
        mask_BT[b, :length] = 1
    sample_BT = torch.randint(0, args.samples, (B, 1), generator=gen).expand(B, T).clone()
    sample_BT[mask_BT == 0] = -1
    input_ids = torch.randint(1, args.vocab_size, (B, T), generator=gen)
    input_ids[mask_BT == 0] = 0
    labels = torch.where((span_BT == SPAN_A) & (mask_BT == 1), input_ids, torch.full_like(input_ids, -100))
    batch = {"input_ids": input_ids, "attention_mask": mask_BT, "labels": labels, "use_cache": False}
    return batch, {"sample_BT": sample_BT, "span_BT": span_BT, "attention_mask_BT": mask_BT}


# ---- one method ------------------------------------------------------------------


class Runner:
    """One method: its own copy of the model, its anchor and its optimizer."""

    def __init__(self, name: str, base_model, args, prior: torch.Tensor, num_moe_layers: int):
        self.name = name
        self.model = copy.deepcopy(base_model).train()
        # each method gets only the coefficient it reads: AnchorConfig refuses a leftover one
        self.config = AnchorConfig.for_method(name, lambda_=args.lambda_, lbl_coef=args.lbl_coef, beta=args.beta)
        self.prior = prior if METHODS[name].needs_prior else None
        self.sigma_LE = permutations(args, name, num_moe_layers)
        self.handle = install_anchor(self.model, self.config, prior=self.prior, sigma_LE=self.sigma_LE)
        params = [p for p in self.model.parameters() if p.requires_grad]
        try:
            self.optimizer = torch.optim.AdamW(params, lr=args.lr, fused=True)
        except RuntimeError:  # a torch without the fused CPU kernel
            self.optimizer = torch.optim.AdamW(params, lr=args.lr)
        self.times: list[float] = []
        self.last_loss = float("nan")

    def check(self, batch: dict, ctx: dict) -> str:
        """One untimed forward with statistics: evidence that the anchor is engaged."""
        method = METHODS[self.name]
        self.handle.remove()
        handle = install_anchor(self.model, self.config, self.prior, self.sigma_LE, record_stats=True)
        try:
            with handle.step(**ctx):
                self.model(**batch)
                aux = handle.loss()
            stats = handle.reset_stats()
            changed = sum(s.changed for s in stats.values()) / max(sum(s.content for s in stats.values()), 1)
            frozen = all(not lay.moe.router.weight.requires_grad for lay in handle.layers)
        finally:
            handle.remove()
        self.handle = install_anchor(self.model, self.config, prior=self.prior, sigma_LE=self.sigma_LE)
        if method.needs_prior:
            if changed <= 0 and not (method.selection == "soft" and self.config.beta == 0):
                raise RuntimeError(f"{self.name}: the anchor changed no selection")
            return f"{changed:.0%} of tokens re-routed"
        if method.loss is not None:
            if not aux.requires_grad:
                raise RuntimeError(f"{self.name}: the anchor loss is not differentiable")
            return f"aux term {float(aux.detach()):.3g}"
        if method.freeze_router:
            if not frozen:
                raise RuntimeError(f"{self.name}: the router is not frozen")
            return "routers frozen"
        return "native routing"

    def step(self, batch: dict, ctx: dict) -> float:
        started = time.perf_counter()
        with self.handle.step(**ctx):
            loss = self.model(**batch).loss + self.handle.loss()
            loss.backward()
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        elapsed = time.perf_counter() - started
        self.last_loss = float(loss.detach())
        return elapsed


# ---- main ------------------------------------------------------------------------


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    torch.manual_seed(args.seed)
    base = build_model(args)
    c = base.config
    num_moe_layers = c.num_hidden_layers - c.first_k_dense_replace
    prior = random_prior(args, num_moe_layers)
    gen = torch.Generator().manual_seed(args.seed + 3)
    batches = [synthetic_batch(args, gen) for _ in range(args.batches)]

    params = sum(p.numel() for p in base.parameters())
    expert_params = sum(p.numel() for n, p in base.named_parameters() if ".mlp.experts." in n)
    shares = matmul_shares(c, args.seq_len)
    masks = torch.stack([ctx["attention_mask_BT"] for _, ctx in batches]).bool()
    spans = torch.stack([ctx["span_BT"] for _, ctx in batches])
    content = float(((spans >= 0) & masks).sum() / masks.sum())
    print(
        f"model: {c.model_type}, hidden {c.hidden_size}, {c.num_hidden_layers} layers (first {c.first_k_dense_replace} "
        f"dense, intermediate {c.intermediate_size}), {num_moe_layers} MoE layers x {c.n_routed_experts} experts "
        f"top-{c.num_experts_per_tok}, {c.n_shared_experts} shared, moe_intermediate {c.moe_intermediate_size}, "
        f"vocab {c.vocab_size}"
    )
    print(
        f"  {params / 1e6:.1f} M parameters ({expert_params / 1e6:.1f} M routed experts); matmul share per token: "
        f"routed experts {shares['routed']:.0%}, shared experts {shares['shared']:.0%}, rest {shares['rest']:.0%}"
    )
    print(
        f"  {next(base.parameters()).dtype}, attention {c._attn_implementation}, "
        f"experts {getattr(c, '_experts_implementation', None)}"
    )
    print(
        f"batches: {args.batches} x [{args.batch_size}, {args.seq_len}], {float(masks.float().mean()):.0%} of "
        f"positions unpadded, {content:.0%} of those content (Q/A); prior pi {list(prior.shape)}"
    )
    print(
        f"threads: {torch.get_num_threads()}, rounds: {args.warmup} warm-up + {args.steps} timed, beta {args.beta}, "
        f"lambda {args.lambda_}, lbl_coef {args.lbl_coef}, AdamW lr {args.lr}"
    )

    runners = [Runner(name, base, args, prior, num_moe_layers) for name in args.methods]
    del base
    print("engaged:", "; ".join(f"{r.name}: {r.check(*batches[0])}" for r in runners))

    for rnd in range(args.warmup + args.steps):
        batch, ctx = batches[rnd % len(batches)]
        start = rnd % len(runners)
        this_round = {}
        for r in runners[start:] + runners[:start]:
            this_round[r.name] = r.step(batch, ctx)
            if rnd >= args.warmup:
                r.times.append(this_round[r.name])
        if rnd + 1 == args.warmup or (rnd + 1 - args.warmup) % 10 == 0:
            label = "warm-up done" if rnd + 1 == args.warmup else f"round {rnd + 1 - args.warmup}/{args.steps}"
            print(f"{label}: last sft step {1e3 * this_round['sft']:.0f} ms", flush=True)

    sft = runners[0]
    sft_median = statistics.median(sft.times)
    ratios, medians = {}, {}
    rows = []
    for r in runners:
        median = statistics.median(r.times)
        q1, _, q3 = statistics.quantiles(r.times, n=4) if len(r.times) > 1 else (median, median, median)
        paired = statistics.median(t / s for t, s in zip(r.times, sft.times, strict=True))
        ratio = median / sft_median
        ratios[r.name], medians[r.name] = round(ratio, 4), round(1e3 * median, 2)
        target = None if args.smoke else TARGETS.get(r.name)
        verdict = "" if target is None else ("holds" if ratio <= target else "MISSED")
        rows.append((r.name, 1e3 * median, 1e3 * q1, 1e3 * q3, ratio, paired, target, verdict, r.last_loss))

    print()
    print(f"{'method':<14}{'median ms':>10}{'IQR ms':>16}{'ratio':>8}{'paired':>8}{'target':>9}  {'':<7}{'loss':>8}")
    for name, median, q1, q3, ratio, paired, target, verdict, loss in rows:
        target_s = f"<= {target:.2f}" if target is not None else ""
        print(
            f"{name:<14}{median:>10.1f}{f'{q1:.1f}-{q3:.1f}':>16}{ratio:>8.3f}{paired:>8.3f}{target_s:>9}  "
            f"{verdict:<7}{loss:>8.3f}"
        )
    checked = [n for n in TARGETS if n in ratios and not args.smoke]
    missed = [n for n in checked if ratios[n] > TARGETS[n]]
    summary = ", ".join(f"{n} <= {TARGETS[n]}" for n in TARGETS)
    if args.smoke:
        print("targets: not judged (--smoke: a tiny shape, one step)")
    elif not checked:
        print(f"targets ({summary}): none of these methods was timed")
    else:
        print(f"targets ({summary}): " + (f"MISSED for {', '.join(missed)}" if missed else f"hold ({len(checked)})"))

    result = dict(ratios)
    result["_shape"] = {
        "hidden_size": c.hidden_size,
        "num_layers": c.num_hidden_layers,
        "first_k_dense": c.first_k_dense_replace,
        "intermediate_size": c.intermediate_size,
        "moe_intermediate_size": c.moe_intermediate_size,
        "experts": c.n_routed_experts,
        "top_k": c.num_experts_per_tok,
        "shared_experts": c.n_shared_experts,
        "vocab_size": c.vocab_size,
        "batch_size": args.batch_size,
        "seq_len": args.seq_len,
        "threads": torch.get_num_threads(),
        "beta": args.beta,
        "steps": args.steps,
        "warmup": args.warmup,
    }
    result["_shape"] |= {"smoke": True} if args.smoke else {}  # a smoke run's figures are no measurement
    result["_median_ms"] = medians
    result["_targets"] = {n: TARGETS[n] for n in checked}
    print(json.dumps(result))


if __name__ == "__main__":
    main()
