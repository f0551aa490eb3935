"""Model types that ship without a transformers mapping, aliased to the native classes that implement them.

Kimi-K2 is DeepSeek-V3-shaped (its published config.json names ``DeepseekV3ForCausalLM``) but declares
``"model_type": "kimi_k2"``, which transformers (5.24) does not map: ``AutoConfig`` fails before any
weight is read, and rpb never runs remote code. ``register_model_aliases`` maps it, explicitly, to
DeepSeek-V3's config and model classes (the router facts: ``ADAPTERS["kimi_k2"]``). Called by
``rpb.models`` before every load; registering twice is a no-op.
"""

from __future__ import annotations

#: alias model_type -> the native model_type whose classes implement it
MODEL_ALIASES = {"kimi_k2": "deepseek_v3"}


def register_model_aliases() -> None:
    from transformers import AutoConfig, AutoModel, AutoModelForCausalLM
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING
    from transformers.models.deepseek_v3 import DeepseekV3Config, DeepseekV3ForCausalLM, DeepseekV3Model

    native = {"deepseek_v3": (DeepseekV3Config, DeepseekV3Model, DeepseekV3ForCausalLM)}
    for alias, target in MODEL_ALIASES.items():
        if alias in CONFIG_MAPPING:
            continue
        config_cls, model_cls, lm_cls = native[target]
        config = type(f"{alias.title().replace('_', '')}Config", (config_cls,), {"model_type": alias})
        AutoConfig.register(alias, config)
        AutoModel.register(config, type(f"{config.__name__[:-6]}Model", (model_cls,), {"config_class": config}))
        AutoModelForCausalLM.register(
            config, type(f"{config.__name__[:-6]}ForCausalLM", (lm_cls,), {"config_class": config})
        )
