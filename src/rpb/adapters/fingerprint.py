"""The routers' fingerprint: what ties a prior to the base model it was read off.

A config hash cannot tell two checkpoints of one architecture apart; the fingerprint can: the
sha256 of every router weight and expert bias, in layer order, each hashed as bfloat16 so that
the same checkpoint loaded in float32 or bfloat16 gives the same value (bf16 rounding of the
same source values is deterministic). ``routers_sha256`` computes it on a loaded model (the
collector, the trainer); ``checkpoint_routers_sha256`` on a checkpoint directory, reading only
the router tensors from its safetensors shards (memory-mapped), so checking a prior against a
16B-671B model never loads the model. Both give the same bytes for the same weights.
"""

from __future__ import annotations

import hashlib
import json
import re
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors import safe_open

from rpb.adapters.aliases import register_model_aliases
from rpb.adapters.hf import MoELayer, RouterFacts, UnsupportedModelError, get_adapter


def fingerprint(tensors_by_layer: list[list[torch.Tensor]]) -> str:
    """sha256 over each layer's tensors in order, each as bfloat16 bytes."""
    h = hashlib.sha256()
    for tensors in tensors_by_layer:
        for t in tensors:
            h.update(t.detach().to("cpu", torch.bfloat16).contiguous().view(torch.int16).numpy().tobytes())
    return h.hexdigest()


def router_tensors(layer: MoELayer, facts: RouterFacts) -> dict[str, torch.Tensor]:
    """What decides one layer's routing, by name: the router's weight, its bias (gpt-oss) and the
    expert-correction bias, the router's or (MiniMax-M2) its MoE block's; the tensors themselves, not copies."""
    owners = {facts.expert_bias: layer.block} if facts.expert_bias_on_block else {}
    return {name: getattr(owners.get(name) or layer.router, name) for name in _router_tensor_names(facts)}


def _router_tensor_names(facts: RouterFacts) -> list[str]:
    """The router's tensors that decide its routing: its weight, and its expert or router bias."""
    return ["weight"] + [name for name in (facts.expert_bias, facts.router_bias) if name is not None]


def routers_sha256(layers: list[MoELayer], facts: RouterFacts) -> str:
    """The fingerprint of a loaded model's routers (``find_moe_layers`` order)."""
    return fingerprint([list(router_tensors(layer, facts).values()) for layer in layers])


@dataclass(frozen=True)
class CheckpointRouters:
    """What a checkpoint directory says about its routers, read without loading the model."""

    model_type: str
    adapter: str
    routers_sha256: str
    moe_layers: list[int]
    num_experts: int
    top_k: int


def _tensor_files(model_dir: Path) -> dict[str, Path]:
    """Tensor name -> the safetensors file holding it (sharded or single-file checkpoints)."""
    index = model_dir / "model.safetensors.index.json"
    if index.is_file():
        weight_map = json.loads(index.read_text())["weight_map"]
        return {name: model_dir / shard for name, shard in weight_map.items()}
    single = model_dir / "model.safetensors"
    if not single.is_file():
        raise UnsupportedModelError(
            f"{model_dir}: no model.safetensors(.index.json); the routers' fingerprint is read from safetensors shards"
        )
    with safe_open(str(single), framework="pt") as f:
        return dict.fromkeys(f.keys(), single)


def _renamer(model_type: str):
    """transformers' own renaming of checkpoint keys to module names for ``model_type`` (e.g. Mixtral's
    ``block_sparse_moe`` -> ``mlp``), so the router's parameters are found under the names the loaded
    model gives them. Key renamings only: the routers are never merged or split on load."""
    try:
        from transformers.conversion_mapping import get_checkpoint_conversion_mapping
        from transformers.core_model_loading import WeightRenaming
    except ImportError:  # an older transformers renames nothing
        return lambda key: key
    renamings = [t for t in get_checkpoint_conversion_mapping(model_type) or [] if isinstance(t, WeightRenaming)]

    def rename(key: str) -> str:
        for t in renamings:
            key, _ = t.rename_source_key(key)
        return key

    return rename


def checkpoint_routers_sha256(model_dir: str | Path, adapter: str | None = None) -> CheckpointRouters:
    """The routers' fingerprint of a checkpoint directory, from the router tensors alone."""
    from transformers import AutoConfig

    model_dir = Path(model_dir)
    register_model_aliases()
    config = AutoConfig.from_pretrained(str(model_dir), trust_remote_code=False)
    facts = get_adapter(adapter or config.model_type)
    pattern = re.compile(facts.router_path)
    rename = _renamer(config.model_type)
    found: dict[int, dict[str, tuple[str, Path]]] = {}
    wanted = _router_tensor_names(facts)
    for name, path in _tensor_files(model_dir).items():
        module, _, param = rename(name).rpartition(".")
        if facts.expert_bias_on_block and param == facts.expert_bias:
            module = f"{module}.{facts.router_module.rpartition('.')[2]}"  # the block's bias: its router's layer
        match = pattern.search(module)
        if match is not None and param in wanted:
            found.setdefault(int(match.group(1)), {})[param] = (name, path)
    missing = [f"layer {i}: {p}" for i, params in sorted(found.items()) for p in wanted if p not in params]
    if not found or missing:
        raise UnsupportedModelError(
            f"{model_dir}: no complete router tensors matching {facts.router_path!r} "
            f"({', '.join(missing) or 'none found'}); the {facts.model_type!r} adapter does not fit this checkpoint"
        )
    tensors_by_layer = []
    for layer in sorted(found):
        tensors = []
        for param in wanted:
            name, path = found[layer][param]
            with safe_open(str(path), framework="pt") as f:
                tensors.append(f.get_tensor(name))
        tensors_by_layer.append(tensors)
    return CheckpointRouters(
        model_type=config.model_type,
        adapter=facts.model_type,
        routers_sha256=fingerprint(tensors_by_layer),
        moe_layers=sorted(found),
        num_experts=int(tensors_by_layer[0][0].shape[0]),
        top_k=int(getattr(config.get_text_config(), facts.top_k_config)),  # a multimodal one: its text model's
    )
