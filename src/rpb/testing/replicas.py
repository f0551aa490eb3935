"""Tiny replicas of real checkpoints, built from their published ``config.json`` (``configs/``, vendored
verbatim; each file's repository, path and commit in ``configs/SOURCES.json``), saved with their vendor's chat
template (``rpb.testing.vendors``).

Every routing value stays as the checkpoint sets it: the score function and selection method, the
expert-correction bias, groups, scaling, renormalisation, the number of routed and shared experts,
top-k, the dense-first layout. Only widths shrink, and the number of MoE layers (to two, or to the first layer of
each kind: Qwen3.5's fourth is its first full-attention one). The quantization config goes (the replica's
weights are random float32); ``ROUTING_KEYS`` lists what a test compares with the vendored file.
"""

from __future__ import annotations

import json
import tempfile
from dataclasses import dataclass
from pathlib import Path

CONFIGS = Path(__file__).parent / "configs"


@dataclass(frozen=True)
class Family:
    """A shipped replica: its vendored config's file stem, the chat template it is saved with, and why that
    template stands in when it is not the checkpoint's own (``None``: the checkpoint line's own template)."""

    name: str
    template: str
    stand_in: str | None = None


#: the registry of shipped replicas: a family added here is built, tested and documented like the others
# fmt: skip below: a table of data, kept aligned row by row (the formatter would put one item per line)
FAMILIES = {
    f.name: f
    for f in (
        Family("deepseek_v3", "deepseek_v3_1", "DeepSeek-V3.1's: the same architecture and config; V3's own "
               "template is not vendored"),
        Family("kimi_k2", "kimi_k2"),
        Family("deepseek_v2_lite", "deepseek_v3_1", "DeepSeek-V2-Lite-Chat's template is not vendored; V3.1's has "
               "the same vendor's begin / end-of-sentence tokens"),
        Family("qwen3_30b_a3b", "qwen3"),
        Family("qwen1_5_moe_a2_7b", "qwen3", "Qwen1.5-MoE-A2.7B-Chat's ChatML template is not vendored; Qwen3's is "
               "ChatML with thinking blocks"),
        Family("mixtral_8x7b", "mixtral"),
        Family("olmoe_1b_7b", "qwen3", "OLMoE-1B-7B-Instruct's template is not vendored: ChatML stands in"),
        Family("gpt_oss_20b", "gpt_oss"),
        Family("glm4_5_air", "glm_4_6"),
        Family("minimax_m2", "qwen3", "MiniMax-M2's template is not vendored: ChatML stands in"),
        Family("qwen3_5_moe", "qwen3", "Qwen3.5's own template is not vendored: its predecessor's stands in"),
    )
}  # fmt: skip
#: the checkpoints replicated, by config file stem
REPLICAS = tuple(FAMILIES)

# fmt: skip below: a table of data, kept aligned row by row (the formatter would put one item per line)
ROUTING_KEYS = (
    "model_type", "scoring_func", "topk_method", "n_group", "topk_group", "routed_scaling_factor", "norm_topk_prob",
    "n_routed_experts", "num_experts", "num_local_experts", "num_experts_per_tok", "n_shared_experts",
    "first_k_dense_replace", "moe_layer_freq", "decoder_sparse_step", "mlp_only_layers", "ep_size", "use_routing_bias",
)  # fmt: skip

#: widths of every family, small; the attention and MLA sizes too
# fmt: skip below: a table of data, kept aligned row by row (the formatter would put one item per line)
SHRUNK = {
    "hidden_size": 32, "intermediate_size": 64, "moe_intermediate_size": 8, "num_attention_heads": 4,
    "num_key_value_heads": 4, "head_dim": 8, "kv_lora_rank": 16, "q_lora_rank": None, "qk_rope_head_dim": 8,
    "qk_nope_head_dim": 8, "v_head_dim": 8, "sliding_window": 16, "max_position_embeddings": 4096,
    "shared_expert_intermediate_size": 8, "linear_key_head_dim": 8, "linear_value_head_dim": 8,
    "linear_num_key_heads": 2, "linear_num_value_heads": 4, "rotary_dim": 4,
}  # fmt: skip
#: a multimodal checkpoint's vision tower (Qwen3.5-MoE), small; its output width is the text model's
VISION = {"depth": 1, "hidden_size": 16, "intermediate_size": 16, "num_heads": 2, "out_hidden_size": 32}
DROPPED = ("quantization_config", "auto_map", "torch_dtype", "dtype", "architectures", "transformers_version")


def family_of(family: str) -> Family:
    """The shipped family named by its config stem (``"qwen3_30b_a3b"``), its checkpoint's hub id
    (``"Qwen/Qwen3-30B-A3B"``) or that id's last part, in any case."""
    if family in FAMILIES:
        return FAMILIES[family]
    wanted = family.lower()
    for name in FAMILIES:
        checkpoint = source(name)["checkpoint"].lower()
        if wanted in (checkpoint, checkpoint.rsplit("/", 1)[-1]):
            return FAMILIES[name]
    known = ", ".join(f"{n} ({source(n)['checkpoint']})" for n in FAMILIES)
    raise ValueError(f"no shipped replica {family!r}; the shipped ones: {known}")


def published(name: str) -> dict:
    """The checkpoint's ``config.json`` as it ships."""
    return json.loads((CONFIGS / f"{name}.json").read_text())


def routing_part(config: dict) -> dict:
    """Where a config keeps its routing keys: a multimodal checkpoint's in its ``text_config``."""
    return config.get("text_config", config)


def source(name: str) -> dict:
    """Where the vendored config comes from: ``checkpoint``, ``repository``, ``path``, ``commit`` (and ``hf``)."""
    return json.loads((CONFIGS / "SOURCES.json").read_text())[f"{name}.json"]


def _shrunk_text(real: dict, vocab_size: int) -> dict:
    out = {k: v for k, v in real.items() if k not in DROPPED}
    out |= {k: v for k, v in SHRUNK.items() if k in real or k in ("hidden_size", "num_attention_heads")}
    layers = int(real.get("first_k_dense_replace") or 0) + 2
    if "layer_types" in real:  # every kind of layer the checkpoint has (Qwen3.5's full attention is every 4th)
        layers = max(layers, *(real["layer_types"].index(kind) + 1 for kind in set(real["layer_types"])))
        out["layer_types"] = real["layer_types"][:layers]
    out["num_hidden_layers"] = layers
    return out | {"vocab_size": vocab_size, "pad_token_id": 0, "bos_token_id": None, "eos_token_id": None}


def replica_config(name: str, vocab_size: int) -> dict:
    """The published config with widths shrunk and two MoE layers after its dense-first ones, or as many as
    it takes to hold one layer of each of its kinds (a multimodal checkpoint keeps its shape: its text model
    shrunk so, its vision tower to one small block)."""
    real = published(name)
    if "text_config" not in real:
        return _shrunk_text(real, vocab_size)
    out = {k: v for k, v in real.items() if k not in DROPPED}
    out["text_config"] = _shrunk_text(real["text_config"], vocab_size)
    out["vision_config"] = real["vision_config"] | VISION
    return out


def moe_layer_count(name: str) -> int:
    """How many MoE layers the replica has (every layer after the dense-first ones)."""
    text = routing_part(replica_config(name, vocab_size=8))
    return text["num_hidden_layers"] - int(text.get("first_k_dense_replace") or 0)


def build_replica(name: str, vocab_size: int, seed: int = 0):
    """The replica as its checkpoint's own class builds it, routers randomised (a multimodal one, Qwen3.5-MoE,
    whole: saved with the layout and names of the shipped checkpoint, which rpb then loads as a causal LM)."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM, AutoModelForImageTextToText

    from rpb.adapters.aliases import register_model_aliases
    from rpb.testing.models import randomize_routers

    register_model_aliases()
    cfg = replica_config(name, vocab_size)
    torch.manual_seed(seed)
    auto = AutoModelForImageTextToText if "text_config" in cfg else AutoModelForCausalLM
    model = auto.from_config(AutoConfig.for_model(cfg.pop("model_type"), **cfg), dtype=torch.float32)
    randomize_routers(model, seed + 1, scale=4.0)
    return model.eval()


def replica(family: str, out_dir: str | Path | None = None, *, seed: int = 0) -> Path:
    """Save the tiny replica of a shipped family with its vendor's chat template; returns the directory.

    ``family``: a config stem of ``REPLICAS`` (``"gpt_oss_20b"``), the checkpoint's hub id or its last part
    (``"gpt-oss-20b"``). The directory (``out_dir``, created if missing; a new temporary one when ``None``)
    holds the model's config and random float32 weights (seeded by ``seed``) and a byte-level tokenizer
    carrying the vendor's special tokens and the template ``FAMILIES[...].template`` (a stand-in where the
    checkpoint's own is not vendored, ``Family.stand_in`` says why). ``from_pretrained`` and every rpb
    command that takes ``--model`` read it as they read the real checkpoint.
    """
    from transformers import AutoTokenizer

    from rpb.testing.vendors import vendor_tokenizer

    fam = family_of(family)
    out = Path(tempfile.mkdtemp(prefix=f"rpb-replica-{fam.name}-") if out_dir is None else out_dir)
    out.mkdir(parents=True, exist_ok=True)
    tok = vendor_tokenizer(fam.template)
    # the template in tokenizer_config.json, as these checkpoints shipped it: a chat_template.jinja file is read
    # in text mode, which would turn Kimi-K2's CRLF line ends into LF
    tok.save_pretrained(out, save_jinja_files=False)
    build_replica(fam.name, vocab_size=len(tok), seed=seed).save_pretrained(out)
    # a family's own tokenizer class may add tokens on load (Qwen3.5's adds <|endoftext|>): every id the folder's
    # tokenizer can give needs an embedding row
    loaded = len(AutoTokenizer.from_pretrained(out))
    if loaded > len(tok):
        build_replica(fam.name, vocab_size=loaded, seed=seed).save_pretrained(out)
    return out
