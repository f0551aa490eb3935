"""Checking a prior against a Megatron-Core run: the HF path's checks, on Megatron's routers.

Same fields as ``rpb.anchors.verify`` (data fingerprint, row count, model via its routers'
fingerprint, tokenizer via its chat template, top-k, sequence length, MoE layers, experts),
plus the routed-position rule, which may be reconciled (see
``layout.routed_position_problems``).
"""

from __future__ import annotations

import dataclasses

from rpb.adapters import MoELayer, RouterFacts, routers_sha256
from rpb.anchors.verify import PriorMismatchError, RunFacts, verify_prior
from rpb.integrations.megatron.layout import routed_position_problems
from rpb.integrations.megatron.router import MegatronRouter


def megatron_routers_sha256(routers: list[MegatronRouter]) -> str:
    """The prior's ``routers_sha256`` computed on Megatron's routers.

    The same bytes as the HF fingerprint (every router weight ``[E, H]`` and, where the
    routers have one, the expert bias ``[E]``, in layer order, as bfloat16), so a checkpoint
    converted from the collector's HF model matches it. Call it on the loaded base weights,
    before the first optimizer step (the router weight is replicated over TP ranks).
    """
    has_bias = any(r.module.expert_bias is not None for r in routers)
    facts = RouterFacts(
        "megatron",
        "TopKRouter",
        routers[0].module.score_function if routers else "softmax",
        expert_bias="expert_bias" if has_bias else None,
    )
    layers = [MoELayer(r.hf_layer_index, r.name, r.module) for r in routers]
    return routers_sha256(layers, facts)


def megatron_run_facts(
    routers: list[MegatronRouter],
    *,
    data_sha256: str,
    num_rows: int,
    model: str,
    tokenizer: str,
    chat_template_sha256: str,
    max_seq_len: int,
    routed_positions: str,
    router_transform: str | None = None,
    chat_template_kwargs: dict | None = None,
) -> RunFacts:
    first = routers[0].module
    return RunFacts(
        data_sha256=data_sha256,
        num_rows=num_rows,
        model=model,
        routers_sha256=megatron_routers_sha256(routers),
        tokenizer=tokenizer,
        chat_template_sha256=chat_template_sha256,
        top_k=int(first.topk),
        max_seq_len=int(max_seq_len),
        moe_layers=[r.hf_layer_index for r in routers],
        num_experts=int(first.config.num_moe_experts),
        router_transform=router_transform,
        routed_positions=routed_positions,
        chat_template_kwargs=dict(chat_template_kwargs or {}),
    )


def verify_megatron_prior(
    meta: dict, run: RunFacts, rows: list[tuple[int, list[int]]], path: str = "prior"
) -> str | None:
    """Raise ``PriorMismatchError`` naming every mismatch; return a note when positions were reconciled.

    ``rows`` are ``(sample index, span ids)`` of the sequences the run feeds (only read when
    the routed-position rules differ).
    """
    prior_rule = meta.get("routed_positions")
    position_problems = routed_position_problems(prior_rule, run.routed_positions, rows)
    mismatches: list = []
    try:
        # the routed-position rule is judged above; the other fields as on the HF path
        verify_prior(meta, dataclasses.replace(run, routed_positions=prior_rule), path)
    except PriorMismatchError as e:
        mismatches = list(e.mismatches)
    mismatches += [("routed_positions", prior_rule, f"{run.routed_positions} ({p})") for p in position_problems]
    if mismatches:
        raise PriorMismatchError(path, mismatches)
    if prior_rule != run.routed_positions:
        return (
            f"routed positions reconciled: the prior counted every position, this run never routes each "
            f"sequence's last one, and no row ends on a Q/A token ({len(rows)} rows checked)"
        )
    return None
