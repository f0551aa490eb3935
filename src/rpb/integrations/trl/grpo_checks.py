"""What a GRPO set-up cannot do right, found before anything runs: ``config_problems`` (the config's fields alone)
and ``trainer_problems`` (the anchor against the model and the data, replay against the generation path). Each
problem is named; ``rpb.integrations.trl.GRPOTrainer`` lists them all at once."""

from __future__ import annotations

from rpb.anchors import AnchorHandle
from rpb.integrations.trl.rl_prior import PREPARED_COLUMNS
from rpb.integrations.trl.rollouts import ROUTE_READERS
from rpb.integrations.trl.scaling import SCALING
from rpb.replay import REPLAY_MODES


def config_problems(args) -> list[str]:
    """The config's own conflicts: its fields alone say them."""
    out = []
    if args.router_aux_loss_coef not in (None, 0.0):
        out.append(
            f"router_aux_loss_coef={args.router_aux_loss_coef}: rpb runs add no native load-balancing loss; for a "
            "load-balancing anchor use anchor.method=lbl (one term, rpb's own)"
        )
    if args.loss_type not in SCALING:
        out.append(
            f"loss_type={args.loss_type!r}: the anchors do not know how this TRL loss aggregates its tokens, so "
            f"they cannot be scaled to it (known: {', '.join(sorted(SCALING))})"
        )
    replay = getattr(args, "replay", "off")
    if replay not in REPLAY_MODES:
        out.append(f"replay={replay!r}: one of {', '.join(REPLAY_MODES)}")
    if replay == "R3" and getattr(args, "use_transformers_continuous_batching", False):
        out.append(
            "use_transformers_continuous_batching with replay='R3': the paged generate_batch path mixes requests "
            "in one forward and returns no per-token routes to record; use the regular generate path"
        )
    if getattr(args, "routes_format", "vllm") not in ROUTE_READERS:
        out.append(f"routes_format={args.routes_format!r}: one of {', '.join(ROUTE_READERS)}")
    if replay == "PR2" and not getattr(args, "pr2_lr_scale", 0) > 0:
        out.append(f"pr2_lr_scale={getattr(args, 'pr2_lr_scale', None)!r}: a positive multiple of learning_rate")
    if replay == "PR2" and getattr(args, "deepspeed", None):
        out.append(
            "replay='PR2' with deepspeed: DeepSpeed's engine builds and steps its own optimizer over the model's "
            "parameters, where PR2's predictor (a module beside the model) has no place; not built"
        )
    rollout_dtype = getattr(args, "rollout_dtype", None)
    if rollout_dtype not in (None, "bfloat16"):
        out.append(f"rollout_dtype={rollout_dtype!r}: None or 'bfloat16'")
    elif rollout_dtype is not None and (args.bf16 or args.fp16):
        out.append(
            f"rollout_dtype={rollout_dtype!r} with {'bf16' if args.bf16 else 'fp16'}=True: the training forwards "
            "already run under that autocast (TRL's GRPOConfig defaults bf16=True), so generation would differ "
            "from training in nothing; set bf16=False to train in the model's dtype"
        )
    return out


def trainer_problems(
    args, model, anchor: AnchorHandle | None, columns: tuple = (), has_rollout_func: bool = False
) -> list[str]:
    """What the config cannot say alone: the anchor against the model and the data, replay against the
    generation path."""
    out = []
    replay = getattr(args, "replay", "off")
    if anchor is not None and anchor.model is not model:
        out.append(
            "anchor: installed on another model object than the one given to the trainer; install it on this one "
            "(TRL's own peft_config wrapping is followed, an object swapped by hand is not)"
        )
    if anchor is not None and anchor.method.needs_prior and replay == "R3":
        out.append(
            f"anchor.method={anchor.method.name} with replay='R3': the rollout's routes are bias-free (rollouts "
            "stay bias-free, like the model that will be served), so replaying them cancels the bias's effect on "
            "selection; use R2 (its routes are the biased training forward's own) or off (docs/rl.md)"
        )
    if anchor is not None and anchor.method.needs_prior and replay == "PR2":
        out.append(
            f"anchor.method={anchor.method.name} with replay='PR2': the first forward's routes would be chosen by "
            "the prior's bias and the predictor at once, and the predictor would learn the bias's effect as drift; "
            "use R2 (docs/rl.md)"
        )
    if anchor is not None and anchor.method.needs_prior and not set(PREPARED_COLUMNS) <= set(columns):
        out.append(
            f"anchor.method={anchor.method.name} reads a prior per row and span: build the dataset with "
            "rpb.integrations.trl.prepare_grpo (each row's sample index and rpb's labels of its prompt)"
        )
    if anchor is not None and getattr(anchor.config, "target", None) is not None and replay != "off":
        out.append(
            f"anchor.target with replay={replay!r}: the overlap reads the training forward's router on the replayed "
            "forward's hidden states, which is drift only where the replayed routes are the router's own (docs/rl.md, "
            "'What each figure reads under each mode'), so λ would answer the replay; hold a target with "
            "replay='off', or give a fixed anchor.lambda"
        )
    if replay == "R3" and getattr(args, "use_vllm", False) and not has_rollout_func:
        out.append(
            "use_vllm with replay='R3': TRL's vLLM client returns no routes and rpb does not patch it; hand them in "
            "with a rollout_func returning 'routed_experts' per rollout (docs/rl.md)"
        )
    return out
