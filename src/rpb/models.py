"""Loading a base model and its tokenizer, the dtypes rpb accepts, and where to run.

Shared by every command that touches a model (collect, train, retention, validate, the toy
world, Megatron's prior checks), so they all load, name and fingerprint models alike.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
from pathlib import Path
from typing import Literal, get_args

import torch

from rpb.adapters import ADAPTERS, RouterFacts, get_adapter
from rpb.adapters.aliases import register_model_aliases
from rpb.adapters.hf import unimplemented_routing
from rpb.errors import ArgumentError, RpbError

DtypeName = Literal["float32", "bfloat16", "float16"]
#: the dtypes a model may be loaded in (router math is float32 whatever the weights' dtype)
DTYPES: dict[str, torch.dtype] = dict(
    zip(get_args(DtypeName), (torch.float32, torch.bfloat16, torch.float16), strict=True)
)

# Config keys that say nothing about the network (paths, versions, runtime switches).
_VOLATILE_CONFIG_KEYS = {"_name_or_path", "transformers_version", "dtype", "torch_dtype", "architectures", "auto_map"}


class ModelLoadError(RpbError):
    """A model or tokenizer that cannot be loaded from what was named (no such directory or hub id, no
    config, unreadable files, remote code not allowed); the message is transformers' own."""


def local_path_missing(name: str) -> bool:
    """``name`` can only be a local folder (absolute, relative with ``.`` or ``~``, or more than ``org/name``'s one
    slash) and there is none: transformers would answer about the hub's repo-id form instead."""
    text = str(name)
    local = text.startswith(("/", "./", "../", "~", ".\\")) or text.count("/") > 1 or "\\" in text
    return local and not Path(text).expanduser().exists()


@contextlib.contextmanager
def _loading(what: str, name: str = ""):
    """transformers raises OSError for a path or id it cannot load, ValueError for one it will not (remote
    code without trust_remote_code, an unrecognised config): name it, keep its explanation. A local folder
    that does not exist is said so first."""
    if name and local_path_missing(name):
        raise ModelLoadError(f"cannot load {what}: no folder {name} (a local path; a hub id is 'org/name')")
    try:
        yield
    except (OSError, ValueError) as e:
        raise ModelLoadError(f"cannot load {what}: {e}") from e


def torch_dtype(name: str) -> torch.dtype:
    if name not in DTYPES:
        raise ArgumentError(f"dtype must be one of {list(DTYPES)}, got {name!r}")
    return DTYPES[name]


def config_sha256(config) -> str:
    """A hash of the model's configuration, stable across save/load and runtime settings."""
    d = {k: v for k, v in config.to_dict().items() if k not in _VOLATILE_CONFIG_KEYS and not k.startswith("_")}
    return hashlib.sha256(json.dumps(d, sort_keys=True, default=str).encode()).hexdigest()


def resolve_device(device: str = "auto", local_rank: int = 0) -> torch.device:
    """The device to run on; "auto" is CUDA when there is one, else the CPU. A CUDA device
    without an index is the process's own one (``LOCAL_RANK``) when several share a node."""
    if device == "auto":
        device = "cuda" if torch.cuda.is_available() else "cpu"
    d = torch.device(device)
    if d.type != "cuda" or d.index is not None:
        return d
    if local_rank >= torch.cuda.device_count():
        raise ArgumentError(
            f"process LOCAL_RANK={local_rank} has no CUDA device of its own ({torch.cuda.device_count()} visible); "
            "launch at most one process per device, or pass --device cpu"
        )
    return torch.device("cuda", local_rank)


def loading_problems(config, facts: RouterFacts | None, device: torch.device) -> list[str]:
    """What would make the native class run this checkpoint otherwise than it was trained, or not at all
    here, before any weight is read: routing keys the class ignores (``unimplemented_routing``), and
    quantized weights on a CPU."""
    out = unimplemented_routing(config, facts) if facts is not None else []
    quant = getattr(config, "quantization_config", None)
    method = quant.get("quant_method") if isinstance(quant, dict) else getattr(quant, "quant_method", None)
    if method is not None and device.type == "cpu":
        out.append(
            f"quantization_config: quant_method={method!r}: the weights are quantized, and rpb runs the whole base "
            "model forward (collect, calibrate, train, retention), which transformers' quantized kernels do not do "
            "on a CPU; run on a GPU, or dequantize the checkpoint to bfloat16 first and point rpb at that copy "
            "(`rpb validate` reads the routers only and works on it as it is)"
        )
    return out


def _check_loadable(model_id: str, config, facts: RouterFacts | None, device: torch.device) -> None:
    problems = loading_problems(config, facts, device)
    if problems:
        raise ModelLoadError(f"model {model_id!r} is refused before loading its weights:\n  " + "\n  ".join(problems))


def load_base_model(
    model_id: str, dtype: str = "float32", adapter: str | None = None, device: str = "auto"
) -> tuple[torch.nn.Module, RouterFacts]:
    """The base model (decoder stack, no LM head) through transformers' native class, and its router facts.

    Remote modeling code is never run: ``trust_remote_code`` is False for the model
    even where the checkpoint ships its own code (Moonlight does); the config's
    ``model_type`` selects the native implementation. ``adapter`` names the
    model_type whose router facts to use (default: the model's own).
    """
    from transformers import AutoConfig, AutoModel
    from transformers.utils import logging as hf_logging

    dt = torch_dtype(dtype)
    register_model_aliases()
    with _loading(f"model {model_id!r}", model_id):
        config = AutoConfig.from_pretrained(model_id, trust_remote_code=False)
    facts = get_adapter(adapter or config.model_type)  # fail on unsupported families before loading weights
    _check_loadable(model_id, config, facts, resolve_device(device))
    verbosity = hf_logging.get_verbosity()
    hf_logging.set_verbosity_error()  # the LM head (and a multimodal checkpoint's vision tower) is left out on purpose
    try:
        with _loading(f"model {model_id!r}"):
            # a multimodal checkpoint (Qwen3.5-MoE): its text model alone, which the routers belong to
            model = AutoModel.from_pretrained(
                model_id, config=config.get_text_config(), dtype=dt, trust_remote_code=False
            )
    finally:
        hf_logging.set_verbosity(verbosity)
    return model.to(resolve_device(device)).eval(), facts


def load_causal_lm(model_id: str, dtype: str = "float32", experts_implementation: str | None = None) -> torch.nn.Module:
    """The whole model with its LM head (for training and generation), native class, no remote code;
    ``experts_implementation``: transformers' name for the MoE experts' kernel (None: its default;
    ``"rpb_sorted"``: ``rpb.kernels.experts``)."""
    from transformers import AutoConfig, AutoModelForCausalLM

    kernel = {}
    if experts_implementation is not None:
        import rpb.kernels  # noqa: F401  (registers rpb's experts kernels with transformers)

        kernel = {"experts_implementation": experts_implementation}

    register_model_aliases()
    with _loading(f"model {model_id!r}", model_id):
        config = AutoConfig.from_pretrained(model_id, trust_remote_code=False)
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    _check_loadable(model_id, config, ADAPTERS.get(config.model_type), device)
    with _loading(f"model {model_id!r}"):
        return AutoModelForCausalLM.from_pretrained(
            model_id, config=config, dtype=torch_dtype(dtype), trust_remote_code=False, **kernel
        )


def load_tokenizer(tokenizer_id: str, trust_remote_code: bool = False):
    from transformers import AutoTokenizer

    if trust_remote_code:
        remote_tokenizer_imports()
    with _loading(f"tokenizer {tokenizer_id!r}", tokenizer_id):
        return AutoTokenizer.from_pretrained(tokenizer_id, trust_remote_code=trust_remote_code)


def remote_tokenizer_imports() -> None:
    """Let the remote tokenizers of Moonlight and the Kimi line import under transformers 5.

    Their ``tokenization_moonshot.py`` / ``tokenization_kimi.py`` import ``bytes_to_unicode`` from transformers'
    GPT-2 tokenizer module, which transformers 5 no longer has (it kept the function in
    ``convert_slow_tokenizer``), so their code fails on import before it tokenizes anything. The same function is
    put back where that code looks; nothing is replaced, and nothing happens where it is still there.
    """
    import importlib

    # modules by their full names: ``transformers.convert_slow_tokenizer`` is also the name of a function
    converters = importlib.import_module("transformers.convert_slow_tokenizer")
    tokenization_gpt2 = importlib.import_module("transformers.models.gpt2.tokenization_gpt2")
    if not hasattr(tokenization_gpt2, "bytes_to_unicode"):
        tokenization_gpt2.bytes_to_unicode = converters.bytes_to_unicode


def pad_id_of(tokenizer) -> int:
    """The id batches are padded with: the tokenizer's pad token, else 0 (padding never counts: its
    attention mask is 0 and its span is structural, so any id serves)."""
    return tokenizer.pad_token_id if tokenizer.pad_token_id is not None else 0
