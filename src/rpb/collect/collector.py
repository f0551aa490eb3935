"""The collector: run the frozen base model over the data and average its routing per span.

For every row x, span s in {Q, A}, MoE layer l and expert e it computes eq. 2,
pi[x, s, l, e] = mean over the span's tokens of p_base(e | x_t, l), where p_base is
the prior's router transform of the raw logits that the model's own router module
returns; or, for a ``frequency`` prior, the mean over the span's tokens of 1/k if the model's
own selection (``rpb.adapters.chosen_experts``) chose e, else 0. The model runs in eval mode
without gradients, batched with right padding (padding never counts), and without its LM
head: the base model is loaded alone, since the prior needs no vocabulary logits.

At scale (``collect``): the rows are cut into fixed chunks; within a chunk they are batched
by length (less padding) and their results put back in row order; each finished chunk is
written to ``<out>.partial/`` at once, so memory does not grow with the row count and a
killed run resumes where it stopped; under ``torchrun``/``accelerate launch`` the ranks
share the chunks out; the artifact is assembled from the chunks at the end.
"""

from __future__ import annotations

import os
import sys
import time
from pathlib import Path

import torch
from tqdm.auto import tqdm

from rpb.adapters import MoELayer, RouterFacts, chosen_experts, find_moe_layers, routers_sha256
from rpb.collect.clip import clip_table, clipped_shares
from rpb.collect.dist import ranks
from rpb.collect.record import scan_data
from rpb.collect.rows import label_range
from rpb.collect.store import WorkDir, missing_chunks
from rpb.data import Example, collate
from rpb.errors import ArgumentError
from rpb.models import DTYPES, config_sha256, load_base_model, load_tokenizer, pad_id_of, resolve_device
from rpb.observe.hooks import Hooks, RouterCall, on_router_calls
from rpb.prior import (
    NUM_SPANS,
    PRIOR_KINDS,
    ROUTER_TRANSFORMS,
    router_probs,
    selection_sums,
    span_counts,
    span_sums,
)
from rpb.prior.artifact import PriorArtifact, load_artifact

#: rows per chunk: the unit of writing, of resuming and of sharing out, and the window rows
#: are batched by length within
DEFAULT_CHUNK_ROWS = 256


class SpanAccumulator:
    """Router hooks (``rpb.observe``) that turn each router's logits into per-span probability sums, or (``kind``
    frequency) each router's selection into per-span selection sums (``facts``: the family, whose own selection
    is read where the router returns none).

    Set ``span_BT`` before each forward; after it, ``sums_LBSE`` holds the batch's sums.
    The hooks are removed when the context exits, leaving the model as it was.
    """

    def __init__(
        self, layers: list[MoELayer], transform: str, kind: str = "probability", facts: RouterFacts | None = None
    ):
        if kind == "frequency" and facts is None:
            raise ArgumentError("a frequency prior needs the family's facts to read each router's selection")
        self.layers = layers
        self.transform, self.kind, self.facts = transform, kind, facts
        self.span_BT: torch.Tensor | None = None
        self._sums: list[torch.Tensor | None] = [None] * len(layers)
        self._hooks = Hooks()

    def _add(self, call: RouterCall) -> None:
        logits, _, _ = call.read()
        B, T = self.span_BT.shape
        if logits.shape[0] != B * T:
            raise RuntimeError(f"router {call.layer.name} returned {logits.shape[0]} rows for a {B}x{T} batch")
        if self.kind == "frequency":
            ids_BTK = chosen_experts(call.layer, self.facts, call.output).detach().view(B, T, -1)
            self._sums[call.pos] = selection_sums(ids_BTK, self.span_BT, logits.shape[-1])
        else:
            probs_BTE = router_probs(logits.detach(), self.transform).view(B, T, -1)
            self._sums[call.pos] = span_sums(probs_BTE, self.span_BT)

    def __enter__(self):
        self._hooks = on_router_calls(self.layers, self._add)
        return self

    def __exit__(self, *exc):
        self._hooks.remove()

    def take(self) -> torch.Tensor:
        if any(s is None for s in self._sums):
            missing = [self.layers[i].name for i, s in enumerate(self._sums) if s is None]
            raise RuntimeError(f"routers {missing} did not run in the forward pass")
        out = torch.stack(self._sums, dim=0)  # [L, B, S, E]
        self._sums = [None] * len(self.layers)
        return out


class Progress:
    """One rows/s bar with tokens/s for a whole run, however many chunks it takes."""

    def __init__(self, total: int, enabled: bool = True):
        self.bar = tqdm(total=total, unit="row", desc="collect", disable=not enabled, dynamic_ncols=True)
        self.tokens, self.started = 0, time.perf_counter()

    def update(self, rows: int, tokens: int) -> None:
        self.tokens += tokens
        self.bar.update(rows)
        self.bar.set_postfix(tok_s=f"{self.tokens / max(time.perf_counter() - self.started, 1e-9):,.0f}", refresh=False)

    def close(self) -> None:
        self.bar.close()


def plan_batches(lengths: list[int], batch_size: int, bucket: bool = True) -> list[list[int]]:
    """Positions of each batch. ``bucket``: longest first, so rows of like length share a batch
    (less padding; the longest batch comes first, so running out of memory shows at once)."""
    order = sorted(range(len(lengths)), key=lambda i: (-lengths[i], i)) if bucket else list(range(len(lengths)))
    return [order[start : start + batch_size] for start in range(0, len(order), batch_size)]


@torch.inference_mode()
def collect_prior(
    model: torch.nn.Module,
    layers: list[MoELayer],
    examples: list[Example],
    transform: str = "softmax",
    batch_size: int = 8,
    pad_id: int = 0,
    progress: bool | Progress = True,
    bucket: bool = True,
    kind: str = "probability",
    facts: RouterFacts | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(prior_NSLE, span_tokens_NS)`` for ``examples``, in their order (pure compute, no files). ``kind``
    ``frequency``: the selection-frequency prior, read with the family's ``facts``."""
    if transform not in ROUTER_TRANSFORMS:
        raise ArgumentError(f"router transform must be one of {ROUTER_TRANSFORMS}, got {transform!r}")
    if kind not in PRIOR_KINDS:
        raise ArgumentError(f"prior kind must be one of {PRIOR_KINDS}, got {kind!r}")
    num_experts = layers[0].router.weight.shape[0]
    prior = torch.zeros(len(examples), NUM_SPANS, len(layers), num_experts, dtype=torch.float32)
    counts = torch.zeros(len(examples), NUM_SPANS, dtype=torch.int64)
    device = next(model.parameters()).device
    bar = progress if isinstance(progress, Progress) else Progress(len(examples), progress)
    with SpanAccumulator(layers, transform, kind, facts) as acc:
        for positions in plan_batches([len(e) for e in examples], batch_size, bucket):
            b = collate([examples[i] for i in positions], pad_id)
            acc.span_BT = b["span_ids"].to(device)
            model(input_ids=b["input_ids"].to(device), attention_mask=b["attention_mask"].to(device), use_cache=False)
            sums_BSLE = acc.take().cpu().permute(1, 2, 0, 3)
            counts_BS = span_counts(b["span_ids"])
            rows = torch.tensor(positions)
            # eq. 2; every span has tokens (rows where one has none are rejected up front)
            prior[rows] = sums_BSLE / counts_BS[:, :, None, None]
            counts[rows] = counts_BS
            bar.update(len(positions), int(b["attention_mask"].sum()))
    if bar is not progress:
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
    chunk_rows: int = DEFAULT_CHUNK_ROWS,
    bucket: bool = True,
    chat_template_kwargs: dict | None = None,
    prior_kind: str = "probability",
) -> PriorArtifact:
    """Collect the prior of ``model_id`` over ``data_jsonl`` into ``out_path``, chunk by chunk.

    Every check that needs no model compute runs first: the arguments, every row of the data
    file (all bad rows reported at once), an interrupted run's record against this one, the
    model's top-k. Run under ``torchrun`` or ``accelerate launch``, each process takes its share
    of the chunks; rerun after an interruption, only the missing chunks are computed. Returns
    the artifact, memory-mapped. ``prior_kind`` ``frequency``: the share of each span's tokens that chose each
    expert, divided by top-k (what an engine's routes give; ``rpb collect --from-routes``).
    """
    problems = []
    if router_transform not in ROUTER_TRANSFORMS:
        problems.append(f"--router-transform must be one of {ROUTER_TRANSFORMS}, got {router_transform!r}")
    if batch_size < 1:
        problems.append(f"--batch-size must be >= 1, got {batch_size}")
    if chunk_rows < 1:
        problems.append(f"--chunk-rows must be >= 1, got {chunk_rows}")
    if dtype not in DTYPES:
        problems.append(f"--dtype must be one of {list(DTYPES)}, got {dtype!r}")
    if prior_kind not in PRIOR_KINDS:
        problems.append(f"--prior-kind must be one of {list(PRIOR_KINDS)}, got {prior_kind!r}")
    if problems:
        raise ArgumentError("; ".join(problems))
    tokenizer_id = tokenizer_id or model_id
    tokenizer = load_tokenizer(tokenizer_id, trust_remote_code)
    scanned = scan_data(
        data_jsonl,
        tokenizer,
        model_id=model_id,
        tokenizer_id=tokenizer_id,
        max_seq_len=max_seq_len,
        top_k=top_k,
        router_transform=router_transform,
        prior_kind=prior_kind,
        dtype=dtype,
        chat_template_kwargs=chat_template_kwargs,
    )
    rows, template, run = scanned.rows, scanned.template, scanned.run
    WorkDir(out_path, run, chunk_rows).check()  # a mismatched interrupted run is refused before the model loads

    with ranks() as rk:
        model, facts = load_base_model(model_id, dtype, adapter, str(resolve_device(device, rk.local_rank)))
        model_top_k = getattr(model.config, facts.top_k_config)
        if top_k != model_top_k:
            raise ArgumentError(
                f"--top-k {top_k} does not match the model's own top-k ({facts.top_k_config}={model_top_k})"
            )
        layers = find_moe_layers(model, facts)
        run |= {
            "model_type": model.config.model_type,
            "adapter": facts.model_type,
            "model_config_sha256": config_sha256(model.config),
            "routers_sha256": routers_sha256(layers, facts),
            "moe_layers": [m.layer_index for m in layers],
            "num_experts": int(layers[0].router.weight.shape[0]),
        }
        store = WorkDir(out_path, run, chunk_rows)
        with missing_chunks(store, rk, "to collect") as todo:
            pad_id = pad_id_of(tokenizer)
            bar = Progress(sum(b - a for a, b in todo), progress and rk.main)  # rank 0's share stands for all
            for a, b in todo:
                examples = label_range(rows, template, max_seq_len, a, b)
                prior, counts = collect_prior(
                    model, layers, examples, router_transform, batch_size, pad_id, bar, bucket, prior_kind, facts
                )
                store.write_chunk(a, b, prior, counts, rows.row_sha256(a, b))
                del examples, prior, counts  # else the last chunk's prior lives on through the next one's compute
            bar.close()
        if rk.main:
            store.assemble(run, len(layers), run["num_experts"], rows.digests)
            store.remove()
        rk.barrier()
    artifact = load_artifact(out_path)
    if progress and int(os.environ.get("RANK", "0")) == 0:
        share_SL = clipped_shares(artifact.prior_qa)
        print(clip_table(share_SL, run["moe_layers"], prior_kind), file=sys.stderr)
    return artifact
