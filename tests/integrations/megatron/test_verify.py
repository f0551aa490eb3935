"""The prior checks on Megatron's routers: the HF fingerprint on the same weights, the HF fields,
routed-position rules reconciled or refused."""

from __future__ import annotations

import hashlib

import pytest
import torch

pytest.importorskip("megatron.core", reason="megatron-core is an optional extra: pip install 'rpb[megatron]'")


from rpb.anchors import AnchorConfig
from rpb.anchors.verify import PriorMismatchError
from rpb.integrations.megatron import (
    ROUTED_ALL_BUT_LAST,
    ROUTED_ALL_POSITIONS,
    install_megatron_anchor,
    megatron_routers_sha256,
    megatron_run_facts,
    verify_megatron_prior,
)
from tests.integrations.megatron.routers import (
    CASES,
    NUM_PRIOR_ROWS,
    E,
    S,
    build_routers,
)


# ----------------------------------------------------------------------------- prior verification
def test_fingerprint_is_the_hf_one_on_the_same_weights():
    routers = build_routers(CASES["sigmoid-bias-groups"])
    handle = install_megatron_anchor(routers, AnchorConfig(method="sft"))
    h = hashlib.sha256()
    for r in routers:  # the HF adapter hashes gate weight, then e_score_correction_bias, as bfloat16
        for t in (r.weight, r.expert_bias):
            h.update(t.detach().to(torch.bfloat16).view(torch.int16).numpy().tobytes())
    assert megatron_routers_sha256(handle.routers) == h.hexdigest()
    handle.remove()


def run_facts(routers, routed_positions=ROUTED_ALL_POSITIONS, **changes):
    handle = install_megatron_anchor(routers, AnchorConfig(method="sft"))
    facts = megatron_run_facts(
        handle.routers, data_sha256="d" * 64, num_rows=NUM_PRIOR_ROWS, model="moonlight", tokenizer="moonlight",
        chat_template_sha256="c" * 64, max_seq_len=S, routed_positions=routed_positions,
    )  # fmt: skip
    handle.remove()
    meta = {
        "data_sha256": "d" * 64, "num_rows": NUM_PRIOR_ROWS, "model": "moonlight", "tokenizer": "moonlight",
        "routers_sha256": facts.routers_sha256, "chat_template_sha256": "c" * 64, "top_k": CASES["softmax"].topk,
        "max_seq_len": S, "routed_positions": ROUTED_ALL_POSITIONS, "moe_layers": [1, 2], "num_experts": E,
    }  # fmt: skip
    meta.update(changes)
    return meta, facts


def test_verify_checks_the_hf_fields_and_reconciles_routed_positions():
    routers = build_routers(CASES["softmax"])
    meta, facts = run_facts(routers)
    assert verify_megatron_prior(meta, facts, rows=[]) is None
    assert facts.moe_layers == [1, 2]  # megatron layer numbers 2, 3 are HF decoder layers 1, 2

    meta, facts = run_facts(routers, ROUTED_ALL_BUT_LAST)
    ends_structural = [(0, [-1, 0, 1, -1]), (1, [-1, 1, -1])]
    assert "reconciled" in verify_megatron_prior(meta, facts, ends_structural)
    with pytest.raises(PriorMismatchError, match=r"routed_positions.*rows 1"):
        verify_megatron_prior(meta, facts, [(0, [-1, 0, 1, -1]), (1, [-1, 0, 1, 1])])

    meta, facts = run_facts(routers, top_k=6, moe_layers=[1, 2, 3], num_experts=64, routers_sha256="0" * 64)
    with pytest.raises(PriorMismatchError) as err:
        verify_megatron_prior(meta, facts, rows=[])
    fields = [m[0] for m in err.value.mismatches]
    assert fields == ["model", "routers_sha256", "top_k", "moe_layers", "num_experts"]
