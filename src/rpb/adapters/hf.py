"""Per-architecture router facts for Hugging Face transformers (v5) MoE models.

In transformers v5 every MoE block owns a router module (``mlp.gate``) whose forward
returns ``(router_logits, combine_weights, expert_indices)``. What differs between
families is recorded here as data, one ``RouterFacts`` per ``config.model_type``,
never as if/elif chains on names. Adding a family = one ``register_adapter`` call
(plus a parity test), e.g. for a fine-tuned variant with its own model_type::

    from rpb.adapters import ADAPTERS, register_adapter
    register_adapter(dataclasses.replace(ADAPTERS["qwen3_moe"], model_type="my_moe"))

The selection facts (score function, expert bias, groups, normalisation, scaling)
describe the model's own routing pipeline, which the training anchors reproduce.
"""

from __future__ import annotations

import dataclasses
import re
from dataclasses import dataclass

import torch
from torch import nn

from rpb.errors import ArgumentError, RpbError
from rpb.routing import SCORE_FUNCTIONS, RouterSpec, select


@dataclass(frozen=True)
class NativeValue:
    """A routing key of ``config.json`` the native class does not read: the values it implements anyway.
    A config giving another value would be routed differently from what the checkpoint was trained
    with, without a word from transformers; rpb refuses it before any compute."""

    key: str
    implemented: tuple
    #: what the native class does, whatever the key says
    behaviour: str


@dataclass(frozen=True)
class RouterFacts:
    model_type: str
    #: class name of the router module, checked so a wrong match fails loudly
    router_class: str
    #: "sigmoid", "softmax" or "topk-softmax" (``rpb.routing.SCORE_FUNCTIONS``): what the router ranks by
    score_function: str
    #: regex on module names; group 1 is the decoder-layer index
    router_path: str = r"(?:^|\.)layers\.(\d+)\.mlp\.gate$"
    #: router buffer added to scores for selection only (DeepSeek-V3 / Moonlight)
    expert_bias: str | None = None
    #: the router's own bias parameter, inside its logits (gpt-oss): fingerprinted, and part of the base router
    router_bias: str | None = None
    #: the expert bias is the MoE block's (the router's parent), handed to the router's forward (MiniMax-M2)
    expert_bias_on_block: bool = False
    #: group-limited top-k: None, "top2-sum" (DeepSeek-V3: groups ranked by the sum of their two
    #: best biased scores, losers masked to -inf) or "max" (DeepSeek-V2: by their best score,
    #: losers masked to 0)
    group_scoring: str | None = None
    #: router attributes holding the number of groups and of groups kept
    group_attrs: tuple[str, str] = ("num_group", "topk_group")
    #: (router attribute, value) that switches group-limited routing on (DeepSeek-V2's topk_method)
    group_switch: tuple[str, str] | None = None
    #: whether the top-k weights are renormalised: True, False, or the router attribute that says
    normalize: bool | str = "norm_topk_prob"
    #: added to the denominator of the renormalisation (DeepSeek-V3 adds 1e-20)
    normalize_eps: float = 0.0
    #: router attribute holding the scaling factor of the combine weights (None = 1)
    scaling_attr: str | None = None
    #: whether the model's top-k returns its experts sorted (torch.topk's ``sorted``)
    topk_sorted: bool = True
    #: whether the combine weights are cast back to the logits' dtype (Qwen, OLMoE) or stay float32
    weights_in_logits_dtype: bool = False
    #: router attribute with the top-k, and config attribute with the same
    top_k_attr: str = "top_k"
    top_k_config: str = "num_experts_per_tok"
    #: the router module's name within a decoder layer (PEFT's modules_to_save key)
    router_module: str = "mlp.gate"
    #: the MoE block's gate on its shared expert (Qwen2-MoE, Qwen3.5-MoE: a one-output Linear whose sigmoid scales the
    #: shared expert's output). It routes nothing, so no anchor or fingerprint reads it; ``put_routers`` copies it
    #: only when asked (``rpb retention --revert-routers --shared-expert-gates``)
    shared_gate: str | None = None
    #: the routed experts' fused weights (transformers v5), which LoRA targets by parameter. Every parameter of the
    #: module holding them is per expert (gpt-oss's ``[E, out]`` biases too): train.only_experts masks them all
    expert_parameters: tuple[str, ...] = ("mlp.experts.gate_up_proj", "mlp.experts.down_proj")
    #: config keys the native class ignores, and the values it implements (``unimplemented_routing``)
    native_values: tuple[NativeValue, ...] = ()


ADAPTERS: dict[str, RouterFacts] = {}


def register_adapter(facts: RouterFacts, *, overwrite: bool = False) -> RouterFacts:
    """Add (or, with overwrite=True, replace) the router facts for a model_type."""
    if facts.model_type in ADAPTERS and not overwrite:
        raise ArgumentError(f"an adapter for model_type {facts.model_type!r} exists; pass overwrite=True to replace it")
    if facts.score_function not in SCORE_FUNCTIONS:
        raise ArgumentError(f"score_function must be one of {SCORE_FUNCTIONS}, got {facts.score_function!r}")
    ADAPTERS[facts.model_type] = facts
    return facts


_DEEPSEEK_V3_NATIVE = (
    NativeValue("scoring_func", ("sigmoid",), "scores every expert with a sigmoid"),
    NativeValue("topk_method", ("noaux_tc",), "selects with the expert-correction bias and group-limited top-k"),
)
for _facts in (
    RouterFacts(
        "deepseek_v3",
        "DeepseekV3TopkRouter",
        "sigmoid",
        expert_bias="e_score_correction_bias",
        group_scoring="top2-sum",
        normalize_eps=1e-20,
        scaling_attr="routed_scaling_factor",
        topk_sorted=False,
        native_values=_DEEPSEEK_V3_NATIVE,
    ),
    RouterFacts(
        "deepseek_v2",
        "DeepseekV2TopkRouter",
        "softmax",
        group_scoring="max",
        group_switch=("topk_method", "group_limited_greedy"),
        normalize=False,  # DeepSeek-V2 never renormalises its top-k weights
        scaling_attr="routed_scaling_factor",
        topk_sorted=False,
        native_values=(
            NativeValue("scoring_func", ("softmax",), "scores every expert with a softmax"),
            NativeValue("norm_topk_prob", (False,), "never renormalises the top-k weights"),
            NativeValue("topk_method", ("greedy", "group_limited_greedy"), "implements these two only"),
        ),
    ),
    RouterFacts("qwen3_moe", "Qwen3MoeTopKRouter", "softmax", weights_in_logits_dtype=True),
    RouterFacts(
        "qwen2_moe", "Qwen2MoeTopKRouter", "softmax", weights_in_logits_dtype=True, shared_gate="shared_expert_gate"
    ),
    RouterFacts("olmoe", "OlmoeTopKRouter", "softmax", weights_in_logits_dtype=True),
    RouterFacts("mixtral", "MixtralTopKRouter", "softmax", normalize=True),
    # MiniMax-M2: sigmoid, the expert-correction bias kept on the MoE block, always renormalised, no groups
    RouterFacts(
        "minimax_m2",
        "MiniMaxM2TopKRouter",
        "sigmoid",
        expert_bias="e_score_correction_bias",
        expert_bias_on_block=True,
        normalize=True,
        topk_sorted=False,
        native_values=(
            NativeValue("scoring_func", ("sigmoid",), "scores every expert with a sigmoid"),
            NativeValue("use_routing_bias", (True,), "always selects with the block's expert-correction bias"),
            NativeValue("shared_intermediate_size", (0,), "builds no shared expert"),
        ),
    ),
    # gpt-oss: top-k of the logits (its router has a bias, inside the logits), softmax over the chosen
    RouterFacts(
        "gpt_oss",
        "GptOssTopKRouter",
        "topk-softmax",
        router_path=r"(?:^|\.)layers\.(\d+)\.mlp\.router$",
        router_bias="bias",
        router_module="mlp.router",
        normalize=False,
    ),
):
    register_adapter(_facts)
# GLM-4.5 routes as DeepSeek-V3 does (sigmoid, expert-correction bias, groups by their two best) in a class of
# its own, whose config has no scoring_func / topk_method to check
register_adapter(
    dataclasses.replace(
        ADAPTERS["deepseek_v3"], model_type="glm4_moe", router_class="Glm4MoeTopkRouter", native_values=()
    )
)
# Qwen3.5-MoE: softmax, the top-k always renormalised (its router has no norm_topk_prob). The shipped checkpoints
# are multimodal (model_type qwen3_5_moe); AutoModelForCausalLM loads their text model (qwen3_5_moe_text)
register_adapter(
    RouterFacts(
        "qwen3_5_moe_text",
        "Qwen3_5MoeTopKRouter",
        "softmax",
        normalize=True,
        weights_in_logits_dtype=True,
        shared_gate="shared_expert_gate",
        native_values=(NativeValue("norm_topk_prob", (True,), "always renormalises the top-k weights"),),
    )
)
register_adapter(dataclasses.replace(ADAPTERS["qwen3_5_moe_text"], model_type="qwen3_5_moe"))
# Kimi-K2 is DeepSeek-V3-shaped and declares its own model_type (rpb.adapters.aliases maps it to DeepSeek-V3's
# classes for transformers)
register_adapter(dataclasses.replace(ADAPTERS["deepseek_v3"], model_type="kimi_k2"))


class UnsupportedModelError(RpbError):
    """No adapter fits the model (unknown model_type, or routers that do not match their facts)."""


def unimplemented_routing(config, facts: RouterFacts) -> list[str]:
    """The routing keys of ``config`` whose value the native class does not implement, each named with what
    the class does instead (empty: the class routes as the config says)."""
    out = []
    text = config.get_text_config() if hasattr(config, "get_text_config") else config  # multimodal: its text model's
    for native in facts.native_values:
        value = getattr(text, native.key, None)
        if value is not None and value not in native.implemented:
            allowed = " or ".join(repr(v) for v in native.implemented)
            out.append(
                f"{native.key}={value!r}: transformers' {facts.model_type} class ignores it and "
                f"{native.behaviour} ({allowed})"
            )
    return out


def get_adapter(model_type: str) -> RouterFacts:
    try:
        return ADAPTERS[model_type]
    except KeyError:
        raise UnsupportedModelError(
            f"no router adapter for model_type {model_type!r}. Supported: {', '.join(sorted(ADAPTERS))}. "
            "If the model routes like a supported family, pass --adapter <that model_type> "
            "(Python: adapter=...); otherwise register its facts with "
            "rpb.adapters.register_adapter(RouterFacts(...)) and add a parity test."
        ) from None


@dataclass(frozen=True)
class MoELayer:
    """One MoE layer of a model: its decoder-layer index and the router module that runs.

    ``wrapper`` is what sits at the router's place when PEFT wrapped it (else None): its
    parameters say whether the router can train (LoRA factors, a trainable copy).
    """

    layer_index: int
    name: str
    router: nn.Module
    wrapper: nn.Module | None = None
    #: the MoE block around the router, where a family keeps its expert bias there (MiniMax-M2)
    block: nn.Module | None = None

    @property
    def trainable(self) -> bool:
        """Whether training can change this router's effective weight."""
        return any(p.requires_grad for p in (self.wrapper or self.router).parameters())


def running_router(module: nn.Module) -> nn.Module:
    """The module that runs in a router's place under PEFT's wrappers (duck-typed: PEFT is optional).

    A router LoRA targets by parameter is a ``ParamWrapper`` whose ``base_layer`` runs with
    base + B·A swapped into its weight during the forward; one under ``modules_to_save`` is a
    wrapper whose active adapter's *copy* runs, the original never does. Hooks must sit on
    the module that runs.
    """
    while True:
        copies = getattr(module, "modules_to_save", None)
        if isinstance(copies, nn.ModuleDict) and isinstance(getattr(module, "original_module", None), nn.Module):
            active = [a for a in getattr(module, "active_adapters", []) if a in copies]
            if getattr(module, "disable_adapters", False) or not active:
                module = module.original_module
            else:
                module = copies[active[0]]
        elif isinstance(getattr(module, "base_layer", None), nn.Module):
            module = module.base_layer
        else:
            return module


def find_moe_layers(model: nn.Module, facts: RouterFacts) -> list[MoELayer]:
    """Every router of ``model`` in layer order, through PEFT's wrappers (``running_router``); fails
    loudly when none or a wrong class matches."""
    pattern = re.compile(facts.router_path)
    found = []
    for name, outer in model.named_modules():
        match = pattern.search(name)
        if match is None:
            continue
        module = running_router(outer)
        if type(module).__name__ != facts.router_class:
            raise UnsupportedModelError(
                f"module {name!r} is a {type(module).__name__}, but the {facts.model_type!r} adapter expects "
                f"{facts.router_class}; the model does not route like {facts.model_type}"
            )
        block = model.get_submodule(name.rpartition(".")[0]) if facts.expert_bias_on_block else None
        found.append(MoELayer(int(match.group(1)), name, module, None if module is outer else outer, block))
    if not found:
        raise UnsupportedModelError(
            f"no router matching {facts.router_path!r} ({facts.router_class}) in the "
            f"{type(model).__name__}; the {facts.model_type!r} adapter does not fit this model"
        )
    found.sort(key=lambda m: m.layer_index)
    return found


def expert_bias_of(layer: MoELayer, facts: RouterFacts) -> torch.Tensor | None:
    """The expert-correction bias that enters this layer's selection (None: the family has none)."""
    if facts.expert_bias is None:
        return None
    return getattr(layer.block if facts.expert_bias_on_block else layer.router, facts.expert_bias)


def call_router(layer: MoELayer, facts: RouterFacts, hidden_TH: torch.Tensor, module: nn.Module | None = None):
    """One forward of what sits at ``layer``'s router place (``module``; default: PEFT's wrapper, else the router)
    on ``hidden_TH``, handed what the family's MoE block hands it beside the hidden states: the block's
    expert-correction bias where the family keeps it there (MiniMax-M2). Returns the router's output as it is
    (``router_output`` reads it)."""
    module = module if module is not None else (layer.wrapper or layer.router)
    extra = (expert_bias_of(layer, facts),) if facts.expert_bias_on_block else ()
    return module(hidden_TH, *extra)


def router_spec(router: nn.Module, facts: RouterFacts) -> RouterSpec:
    """One router's selection pipeline, resolved from its family's facts and its own attributes."""
    group_scoring = facts.group_scoring
    if facts.group_switch is not None and getattr(router, facts.group_switch[0], None) != facts.group_switch[1]:
        group_scoring = None
    num_groups, topk_groups = (getattr(router, a, None) or 1 for a in facts.group_attrs)
    normalize = facts.normalize if isinstance(facts.normalize, bool) else bool(getattr(router, facts.normalize))
    return RouterSpec(
        score_function=facts.score_function,
        top_k=int(getattr(router, facts.top_k_attr)),
        num_experts=int(router.weight.shape[0]),
        group_scoring=group_scoring if num_groups > 1 else None,
        num_groups=int(num_groups),
        topk_groups=int(topk_groups),
        normalize=normalize,
        normalize_eps=facts.normalize_eps,
        scaling=float(getattr(router, facts.scaling_attr)) if facts.scaling_attr else 1.0,
        topk_sorted=facts.topk_sorted,
        weights_in_logits_dtype=facts.weights_in_logits_dtype,
    )


def router_output(layer: MoELayer, output) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor | None]:
    """``(logits_TE, gates_TK, topk_ids_TK)`` of one router forward.

    transformers v5 routers return that triple; a router that returns its logits alone gives
    ``(logits, None, None)``, which is enough for the prior but not for reading its selection.
    """
    if isinstance(output, torch.Tensor):
        return output, None, None
    if isinstance(output, tuple) and len(output) == 3:
        return output
    raise UnsupportedModelError(
        f"router {layer.name} returned a {type(output).__name__}, not the (logits, weights, indices) that "
        "transformers v5 routers return"
    )


def chosen_experts(layer: MoELayer, facts: RouterFacts, output) -> torch.Tensor:
    """``topk_ids_TK``: the experts one router forward chose, as the model runs them: the router's own ids where it
    returns them; else (a router returning its logits alone, the MoE block selecting) the family's own selection on
    those logits (``rpb.routing.select``: score function, expert-correction bias, groups, top-k), which mirrors the
    block's op for op. What an engine's routes record, and what a frequency prior counts."""
    logits_TE, _, ids_TK = router_output(layer, output)
    if ids_TK is not None:
        return ids_TK
    return select(logits_TE, router_spec(layer.router, facts), expert_bias_E=expert_bias_of(layer, facts))
