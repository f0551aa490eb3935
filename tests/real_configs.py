"""Tiny replicas of real checkpoints, built from their published ``config.json`` (tests/fixtures/configs,
vendored verbatim from public GitHub copies named in SOURCES.json).

Every routing value stays as the checkpoint sets it: the score function and selection method, the
expert-correction bias, groups, scaling, renormalisation, the number of routed and shared experts,
top-k, the dense-first layout. Only widths shrink, and the number of MoE layers (to two). The
quantization config goes (the replica's weights are random float32); ``ROUTING_KEYS`` lists what a
test compares with the vendored file.
"""

from __future__ import annotations

import json
from pathlib import Path

FIXTURES = Path(__file__).parent / "fixtures" / "configs"

#: the checkpoints replicated, by fixture file (a Qwen3.5-MoE config is vendored too; rpb does not support it yet)
REPLICAS = ("deepseek_v3", "kimi_k2", "deepseek_v2_lite", "qwen3_30b_a3b", "mixtral_8x7b", "gpt_oss_20b")

ROUTING_KEYS = (
    "model_type", "scoring_func", "topk_method", "n_group", "topk_group", "routed_scaling_factor", "norm_topk_prob",
    "n_routed_experts", "num_experts", "num_local_experts", "num_experts_per_tok", "n_shared_experts",
    "first_k_dense_replace", "moe_layer_freq", "decoder_sparse_step", "mlp_only_layers", "ep_size",
)  # fmt: skip

#: widths of every family, small; the attention and MLA sizes too
SHRUNK = {
    "hidden_size": 32, "intermediate_size": 64, "moe_intermediate_size": 8, "num_attention_heads": 4,
    "num_key_value_heads": 4, "head_dim": 8, "kv_lora_rank": 16, "q_lora_rank": None, "qk_rope_head_dim": 8,
    "qk_nope_head_dim": 8, "v_head_dim": 8, "sliding_window": 16, "max_position_embeddings": 4096,
}  # fmt: skip
DROPPED = ("quantization_config", "auto_map", "torch_dtype", "dtype", "architectures", "transformers_version")


def published(name: str) -> dict:
    return json.loads((FIXTURES / f"{name}.json").read_text())


def source(name: str) -> dict:
    return json.loads((FIXTURES / "SOURCES.json").read_text())[f"{name}.json"]


def replica_config(name: str, vocab_size: int) -> dict:
    """The published config with widths shrunk and two MoE layers after its dense-first ones."""
    real = published(name)
    out = {k: v for k, v in real.items() if k not in DROPPED}
    out |= {k: v for k, v in SHRUNK.items() if k in real or k in ("hidden_size", "num_attention_heads")}
    dense = int(real.get("first_k_dense_replace") or 0)
    out["num_hidden_layers"] = dense + 2
    if "layer_types" in real:
        out["layer_types"] = real["layer_types"][: out["num_hidden_layers"]]
    out |= {"vocab_size": vocab_size, "pad_token_id": 0, "bos_token_id": None, "eos_token_id": None}
    return out


def build_replica(name: str, vocab_size: int, seed: int = 0):
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    from rpb.adapters.aliases import register_model_aliases
    from rpb.testing.models import randomize_routers

    register_model_aliases()
    cfg = replica_config(name, vocab_size)
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(AutoConfig.for_model(cfg.pop("model_type"), **cfg), dtype=torch.float32)
    randomize_routers(model, seed + 1, scale=4.0)
    return model.eval()
