"""Tiny MoE models of every supported family, built from transformers configs.

``ARCHITECTURES`` maps a name to (model_type, config kwargs): per-family facts as
data. Weights are seeded; DeepSeek-V3's ``e_score_correction_bias`` (zero at init)
and all router weights are randomised so that routing is neither uniform nor
bias-free, which would hide mistakes.
"""

from __future__ import annotations

import torch
from transformers import AutoConfig, AutoModelForCausalLM

from rpb.adapters.aliases import register_model_aliases

_COMMON = {"hidden_size": 32, "num_hidden_layers": 3, "num_attention_heads": 4, "num_key_value_heads": 4}
_MLA = {"kv_lora_rank": 16, "q_lora_rank": None, "qk_rope_head_dim": 8, "qk_nope_head_dim": 8, "v_head_dim": 8}

#: name -> (model_type, config overrides). "moonlight" is the Moonlight-16B-A3B shape, scaled down.
#: MiniMax-M2 is not here: its router's forward takes the block's bias as an argument, so the
#: family-parametrized tests that call routers alone do not fit it (tests/adapters/test_hf_minimax.py).
ARCHITECTURES: dict[str, tuple[str, dict]] = {
    "moonlight": (
        "deepseek_v3",
        {
            **_COMMON,
            **_MLA,
            "intermediate_size": 64,
            "moe_intermediate_size": 16,
            "n_routed_experts": 8,
            "num_experts_per_tok": 2,
            "n_shared_experts": 2,
            "n_group": 1,
            "topk_group": 1,
            "first_k_dense_replace": 1,
            "norm_topk_prob": True,
            "routed_scaling_factor": 2.446,
        },
    ),
    "deepseek_v3_grouped": (
        "deepseek_v3",
        {
            **_COMMON,
            **_MLA,
            "intermediate_size": 64,
            "moe_intermediate_size": 16,
            "n_routed_experts": 16,
            "num_experts_per_tok": 4,
            "n_shared_experts": 1,
            "n_group": 4,
            "topk_group": 2,
            "first_k_dense_replace": 1,
            "norm_topk_prob": True,
            "routed_scaling_factor": 2.5,
        },
    ),
    "deepseek_v2": (
        "deepseek_v2",
        {
            **_COMMON,
            **_MLA,
            "intermediate_size": 64,
            "moe_intermediate_size": 16,
            "n_routed_experts": 8,
            "num_experts_per_tok": 2,
            "n_shared_experts": 2,
            "first_k_dense_replace": 1,
            "topk_method": "group_limited_greedy",
            "n_group": 4,
            "topk_group": 2,
            "routed_scaling_factor": 1.0,
        },
    ),
    "qwen3_moe": (
        "qwen3_moe",
        {
            **_COMMON,
            "head_dim": 8,
            "intermediate_size": 64,
            "moe_intermediate_size": 16,
            "num_experts": 8,
            "num_experts_per_tok": 2,
            "norm_topk_prob": True,
            "mlp_only_layers": [0],
        },
    ),
    "qwen2_moe": (
        "qwen2_moe",
        {
            **_COMMON,
            "intermediate_size": 64,
            "moe_intermediate_size": 16,
            "shared_expert_intermediate_size": 32,
            "num_experts": 8,
            "num_experts_per_tok": 2,
            "norm_topk_prob": False,
        },
    ),
    "mixtral": (
        "mixtral",
        {**_COMMON, "intermediate_size": 16, "num_local_experts": 8, "num_experts_per_tok": 2},
    ),
    "olmoe": (
        "olmoe",
        {**_COMMON, "intermediate_size": 16, "num_experts": 8, "num_experts_per_tok": 2, "norm_topk_prob": False},
    ),
    # the router at mlp.router, with a bias (randomised below), softmax over the chosen logits
    "gpt_oss": (
        "gpt_oss",
        {
            **_COMMON,
            "head_dim": 8,
            "intermediate_size": 16,
            "num_local_experts": 8,
            "num_experts_per_tok": 2,
            "sliding_window": 16,
        },
    ),
    # sigmoid + expert-correction bias + groups (DeepSeek-V3's pipeline), first layer dense
    "glm4_moe": (
        "glm4_moe",
        {
            **_COMMON,
            "head_dim": 8,
            "intermediate_size": 64,
            "moe_intermediate_size": 16,
            "n_routed_experts": 16,
            "num_experts_per_tok": 4,
            "n_group": 4,
            "topk_group": 2,
            "first_k_dense_replace": 1,
            "n_shared_experts": 1,
            "routed_scaling_factor": 1.0,
            "norm_topk_prob": True,
            "partial_rotary_factor": 0.5,
        },
    ),
    # Kimi-K2: DeepSeek-V3-shaped under its own model_type (rpb.adapters.aliases)
    "kimi_k2": (
        "kimi_k2",
        {
            **_COMMON,
            **_MLA,
            "intermediate_size": 64,
            "moe_intermediate_size": 16,
            "n_routed_experts": 8,
            "num_experts_per_tok": 2,
            "n_shared_experts": 1,
            "n_group": 1,
            "topk_group": 1,
            "first_k_dense_replace": 1,
            "norm_topk_prob": True,
            "routed_scaling_factor": 2.827,
        },
    ),
}


def tiny_config(arch: str, vocab_size: int, **overrides):
    register_model_aliases()
    try:
        model_type, kwargs = ARCHITECTURES[arch]
    except KeyError:
        raise ValueError(f"unknown toy architecture {arch!r}; choose one of {sorted(ARCHITECTURES)}") from None
    kwargs = {**kwargs, "vocab_size": vocab_size, "pad_token_id": 0, "bos_token_id": None, "eos_token_id": None}
    kwargs.update(overrides)
    return AutoConfig.for_model(model_type, **kwargs)


def randomize_routers(model: torch.nn.Module, seed: int, scale: float = 1.0) -> None:
    """Give every router random weights (std ``scale``), and a random expert-correction bias or router bias
    where it has one."""
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, module in model.named_modules():
            block_bias = getattr(module, "e_score_correction_bias", None)
            if name.endswith(".mlp") and isinstance(block_bias, torch.Tensor):  # MiniMax-M2 keeps it on the block
                block_bias.copy_(torch.randn(block_bias.shape, generator=gen) * 0.1)
            if not name.endswith(("mlp.gate", "mlp.router")) or not hasattr(module, "weight"):
                continue
            module.weight.copy_(torch.randn(module.weight.shape, generator=gen) * scale / module.weight.shape[1] ** 0.5)
            # DeepSeek-V3's expert-correction bias (selection only), gpt-oss's router bias (in the logits)
            for bias in (getattr(module, "e_score_correction_bias", None), getattr(module, "bias", None)):
                if bias is not None:
                    bias.copy_(torch.randn(bias.shape, generator=gen) * 0.1)


def build_tiny_model(arch: str, vocab_size: int, seed: int = 0, **overrides):
    """A seeded tiny causal LM of family ``arch`` with randomised routers, in eval mode."""
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(tiny_config(arch, vocab_size, **overrides))
    randomize_routers(model, seed + 1, scale=4.0)
    return model.eval()
