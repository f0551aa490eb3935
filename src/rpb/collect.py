"""The collector: run the frozen base model over the data and average its routing per span.

For every row x, span s in {Q, A}, MoE layer l and expert e it computes eq. 2,
pi[x, s, l, e] = mean over the span's tokens of p_base(e | x_t, l), where p_base is
the prior's router transform of the raw logits that the model's own router module
returns. The model runs in eval mode without gradients, batched with right padding
(padding never counts), and without its LM head: the base model is loaded alone,
since the prior needs no vocabulary logits.
"""

from __future__ import annotations

import hashlib
import json
import time
from collections.abc import Iterator
from pathlib import Path

import torch
from tqdm.auto import tqdm

import rpb
from rpb.adapters import MoELayer, find_moe_layers, get_adapter, routers_sha256
from rpb.artifact import ROUTED_ALL_POSITIONS, SCHEMA, SCHEMA_VERSION, PriorArtifact, save_artifact
from rpb.data import ChatTemplate, Example, collate, load_labelled
from rpb.data.jsonl import row_digests
from rpb.prior import NUM_SPANS, ROUTER_TRANSFORMS, SPAN_NAMES, router_probs, span_counts, span_sums

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}

# Config keys that say nothing about the network (paths, versions, runtime switches).
_VOLATILE_CONFIG_KEYS = {"_name_or_path", "transformers_version", "dtype", "torch_dtype", "architectures", "auto_map"}


def config_sha256(config) -> str:
    """A hash of the model's configuration, stable across save/load and runtime settings."""
    d = {k: v for k, v in config.to_dict().items() if k not in _VOLATILE_CONFIG_KEYS and not k.startswith("_")}
    return hashlib.sha256(json.dumps(d, sort_keys=True, default=str).encode()).hexdigest()


def resolve_device(device: str = "auto") -> torch.device:
    """The device to run on; "auto" is the first CUDA device when there is one, else the CPU."""
    if device == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    return torch.device(device)


def load_base_model(model_id: str, dtype: str = "float32", adapter: str | None = None, device: str = "auto"):
    """The base model (decoder stack, no LM head) through transformers' native class, and its router facts.

    Remote modeling code is never run: ``trust_remote_code`` is False for the model
    even where the checkpoint ships its own code (Moonlight does); the config's
    ``model_type`` selects the native implementation. ``adapter`` names the
    model_type whose router facts to use (default: the model's own).
    """
    from transformers import AutoConfig, AutoModel
    from transformers.utils import logging as hf_logging

    if dtype not in DTYPES:
        raise ValueError(f"dtype must be one of {sorted(DTYPES)}, got {dtype!r}")
    config = AutoConfig.from_pretrained(model_id, trust_remote_code=False)
    facts = get_adapter(adapter or config.model_type)  # fail on unsupported families before loading weights
    verbosity = hf_logging.get_verbosity()
    hf_logging.set_verbosity_error()  # the LM head is left out on purpose; do not report it
    try:
        model = AutoModel.from_pretrained(model_id, config=config, dtype=DTYPES[dtype], trust_remote_code=False)
    finally:
        hf_logging.set_verbosity(verbosity)
    return model.to(resolve_device(device)).eval(), facts


def load_tokenizer(tokenizer_id: str, trust_remote_code: bool = False):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(tokenizer_id, trust_remote_code=trust_remote_code)


class SpanAccumulator:
    """Forward hooks on every router that turn its logits into per-span probability sums.

    Set ``span_BT`` before each forward; after it, ``sums_LBSE`` holds the batch's sums.
    The hooks are removed when the context exits, leaving the model as it was.
    """

    def __init__(self, layers: list[MoELayer], transform: str):
        self.layers = layers
        self.transform = transform
        self.span_BT: torch.Tensor | None = None
        self._sums: list[torch.Tensor | None] = [None] * len(layers)
        self._handles = []

    def _hook(self, pos: int):
        def hook(module, args, output):
            logits = output[0] if isinstance(output, tuple) else output
            B, T = self.span_BT.shape
            if logits.shape[0] != B * T:
                raise RuntimeError(
                    f"router {self.layers[pos].name} returned {logits.shape[0]} rows for a {B}x{T} batch"
                )
            probs_BTE = router_probs(logits.detach(), self.transform).view(B, T, -1)
            self._sums[pos] = span_sums(probs_BTE, self.span_BT)

        return hook

    def __enter__(self):
        self._handles = [m.router.register_forward_hook(self._hook(i)) for i, m in enumerate(self.layers)]
        return self

    def __exit__(self, *exc):
        for h in self._handles:
            h.remove()
        self._handles = []

    def take(self) -> torch.Tensor:
        if any(s is None for s in self._sums):
            missing = [self.layers[i].name for i, s in enumerate(self._sums) if s is None]
            raise RuntimeError(f"routers {missing} did not run in the forward pass")
        out = torch.stack(self._sums, dim=0)  # [L, B, S, E]
        self._sums = [None] * len(self.layers)
        return out


def batches(examples: list[Example], batch_size: int) -> Iterator[list[Example]]:
    for start in range(0, len(examples), batch_size):
        yield examples[start : start + batch_size]


@torch.inference_mode()
def collect_prior(
    model: torch.nn.Module,
    layers: list[MoELayer],
    examples: list[Example],
    transform: str = "softmax",
    batch_size: int = 8,
    pad_id: int = 0,
    progress: bool = True,
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(prior_NSLE, span_tokens_NS)`` for ``examples`` (pure compute, no files)."""
    if transform not in ROUTER_TRANSFORMS:
        raise ValueError(f"router transform must be one of {ROUTER_TRANSFORMS}, got {transform!r}")
    num_experts = layers[0].router.weight.shape[0]
    prior = torch.zeros(len(examples), NUM_SPANS, len(layers), num_experts, dtype=torch.float32)
    counts = torch.zeros(len(examples), NUM_SPANS, dtype=torch.int64)
    device = next(model.parameters()).device
    total_tokens, started = 0, time.perf_counter()
    bar = tqdm(total=len(examples), unit="row", desc="collect", disable=not progress, dynamic_ncols=True)
    with SpanAccumulator(layers, transform) as acc:
        row = 0
        for batch in batches(examples, batch_size):
            b = collate(batch, pad_id)
            acc.span_BT = b["span_ids"].to(device)
            model(input_ids=b["input_ids"].to(device), attention_mask=b["attention_mask"].to(device), use_cache=False)
            sums_LBSE = acc.take().cpu()
            sums_BSLE = sums_LBSE.permute(1, 2, 0, 3)
            counts_BS = span_counts(b["span_ids"])
            n = len(batch)
            # eq. 2; every span has tokens (load_labelled rejects rows where one has none)
            prior[row : row + n] = sums_BSLE / counts_BS[:, :, None, None]
            counts[row : row + n] = counts_BS
            row += n
            total_tokens += int(b["attention_mask"].sum())
            elapsed = max(time.perf_counter() - started, 1e-9)
            bar.update(n)
            bar.set_postfix(tok_s=f"{total_tokens / elapsed:,.0f}", refresh=False)
    bar.close()
    return prior, counts


def collect(
    model_id: str,
    data_jsonl: str | Path,
    out_path: str | Path,
    top_k: int,
    max_seq_len: int,
    router_transform: str = "softmax",
    batch_size: int = 8,
    dtype: str = "float32",
    trust_remote_code: bool = False,
    tokenizer_id: str | None = None,
    adapter: str | None = None,
    progress: bool = True,
    device: str = "auto",
) -> PriorArtifact:
    """Collect the prior of ``model_id`` over ``data_jsonl`` and write it atomically to ``out_path``.

    Every check that needs no model compute runs first: the transform, the adapter,
    the model's top-k, and every row of the data file (all bad rows reported at once).
    """
    if router_transform not in ROUTER_TRANSFORMS:
        raise ValueError(f"--router-transform must be one of {ROUTER_TRANSFORMS}, got {router_transform!r}")
    if batch_size < 1:
        raise ValueError(f"--batch-size must be >= 1, got {batch_size}")
    tokenizer_id = tokenizer_id or model_id
    tokenizer = load_tokenizer(tokenizer_id, trust_remote_code)
    data = load_labelled(data_jsonl, tokenizer, max_seq_len)  # raises DataError before any compute

    model, facts = load_base_model(model_id, dtype, adapter, device)
    model_top_k = getattr(model.config, facts.top_k_config)
    if top_k != model_top_k:
        raise ValueError(f"--top-k {top_k} does not match the model's own top-k ({facts.top_k_config}={model_top_k})")
    layers = find_moe_layers(model, facts)
    pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else 0
    prior, counts = collect_prior(model, layers, data.examples, router_transform, batch_size, pad_id, progress)

    digests = row_digests(data_jsonl)
    metadata = {
        "schema": SCHEMA,
        "schema_version": SCHEMA_VERSION,
        "rpb_version": rpb.__version__,
        "model": str(model_id),
        "model_type": model.config.model_type,
        "adapter": facts.model_type,
        "model_config_sha256": config_sha256(model.config),
        "routers_sha256": routers_sha256(layers, facts),
        "tokenizer": str(tokenizer_id),
        "chat_template_sha256": ChatTemplate(tokenizer).sha256,
        "router_transform": router_transform,
        "top_k": int(top_k),
        "max_seq_len": int(max_seq_len),
        "routed_positions": ROUTED_ALL_POSITIONS,
        "moe_layers": [m.layer_index for m in layers],
        "num_experts": int(prior.shape[-1]),
        "num_rows": data.num_rows,
        "num_tokens": data.num_tokens,
        "data_sha256": data.sha256,
        "data_file": Path(data_jsonl).name,
        "spans": list(SPAN_NAMES),
        "dtype": dtype,
    }
    artifact = PriorArtifact(
        prior_qa=prior,
        span_tokens=counts,
        row_sha256=torch.frombuffer(bytearray(b"".join(digests)), dtype=torch.uint8).view(-1, 32),
        metadata=metadata,
    )
    save_artifact(artifact, out_path)
    return artifact
