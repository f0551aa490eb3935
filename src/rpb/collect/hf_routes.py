"""``rpb routes``: routes from an HF model in vLLM's exact layout, for a user without an engine (and the tests);
and ``rpb routes --requests``: the token ids to send an engine, rpb's labelling of every row.

Shape legend: B = rows of a batch, P = the batch's right-padded length, L = MoE layers, X = decoder layers,
K = top-k, N = one row's tokens.

Each row is run as the engine runs a prefill-only request: one forward of the row's tokens (the prefill; the one
token an engine then generates is never forwarded, so the row gets one route per token), under the routing-replay
recorder (``rpb.replay.record.GenerationRecorder``), which keeps each MoE layer's top-k at every forwarded
position. Rows are right-padded, as the collector batches them, so each keeps its own positions. The
route is laid out as vLLM returns ``routed_experts`` for the request: ``[num_tokens - 1, num_hidden_layers,
top_k]`` (``num_tokens`` = the row's tokens + the generated one), each MoE layer at its decoder-layer index and a
dense layer's columns left 0, vLLM's ``uint8`` for at most 256 experts, else ``uint16``
(``rpb.replay.engines`` cites the sources). The route file (``rpb.replay.routefile``) records the model's router
fingerprint, so ``rpb collect --from-routes`` refuses it for another model.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import numpy as np
import torch

from rpb.adapters import find_moe_layers, get_adapter, router_spec, routers_sha256
from rpb.collect.collector import plan_batches
from rpb.collect.dist import ranks
from rpb.collect.rows import KEEP_TOKENS, label_range, scan_rows
from rpb.collect.store import MANIFEST, WorkDir, missing_chunks
from rpb.data import ChatTemplate, Example
from rpb.errors import ArgumentError
from rpb.fileio import write_text_atomic
from rpb.models import load_base_model, load_tokenizer, pad_id_of, resolve_device
from rpb.observe.capture import RouterCapture
from rpb.prior import family_transform, router_probs
from rpb.replay.record import GenerationRecorder
from rpb.replay.routefile import load_routes, save_routes
from rpb.replay.routeshards import write_index


def vllm_dtype(num_experts: int) -> np.dtype:
    """vLLM's id type: uint8 up to 256 experts, else uint16 (routed_experts_capturer.py:84)."""
    return np.dtype(np.uint8) if num_experts <= 256 else np.dtype(np.uint16)


@torch.inference_mode()
def hf_routes(
    model,
    examples: list[Example],
    pad_id: int,
    batch_size: int = 8,
    adapter: str | None = None,
    probs_transform: str | None = None,
    top_m: int | None = None,
):
    """Each row's routes in vLLM's layout (``[N, num_hidden_layers, K]``), in ``examples``' order, and the
    routers' fingerprint; ``model``: the base model (``rpb.models.load_base_model``) or the causal LM. With
    ``probs_transform``, also each row's router probabilities at its routed experts (the same layout, float32, the
    router's logits read under that transform; dense layers' columns 0): ``(routes, fingerprint, probs)``. With
    ``top_m`` too, the next ``top_m - K`` experts by probability after the routed ones and their probabilities,
    the same layout: ``(routes, fingerprint, probs, (extra_ids, extra_probs))``."""
    facts = get_adapter(adapter or model.config.model_type)
    layers = find_moe_layers(model, facts)
    num_layers = int(model.config.get_text_config().num_hidden_layers)
    at = [m.layer_index for m in layers]
    num_experts = int(layers[0].router.weight.shape[0])
    out: list[np.ndarray | None] = [None] * len(examples)
    probs: list[np.ndarray | None] = [None] * len(examples)
    extra_ids: list[np.ndarray | None] = [None] * len(examples)
    extra_probs: list[np.ndarray | None] = [None] * len(examples)
    device = next(model.parameters()).device
    for positions in plan_batches([len(e) for e in examples], batch_size):
        P = max(len(examples[i]) for i in positions)
        ids_BP = torch.full((len(positions), P), pad_id, dtype=torch.long)
        mask_BP = torch.zeros((len(positions), P), dtype=torch.long)
        for b, i in enumerate(positions):
            n = len(examples[i])
            ids_BP[b, :n] = torch.tensor(examples[i].input_ids)
            mask_BP[b, :n] = 1
        capture = RouterCapture(layers, stop_early=False)
        with GenerationRecorder(model, layers, facts=facts, logps=False) as rec:
            forward = {"input_ids": ids_BP.to(device), "attention_mask": mask_BP.to(device), "use_cache": False}
            logits_LTE, _ = capture.run(lambda forward=forward: model(**forward))
        routes_BPLK = rec.routes_BSLK  # the prefill's P positions
        if probs_transform is not None:
            probs_BPLE = torch.stack([router_probs(z, probs_transform) for z in logits_LTE], 1).cpu()
            probs_BPLE = probs_BPLE.reshape(len(positions), P, len(layers), -1)
            probs_BPLK = probs_BPLE.gather(-1, routes_BPLK.long())
            if top_m is not None:
                more_BPLJ, more_probs_BPLJ = next_experts(probs_BPLE, routes_BPLK.long(), top_m)
        for b, i in enumerate(positions):
            n = len(examples[i])
            routes_NXK = np.zeros((n, num_layers, routes_BPLK.shape[-1]), dtype=vllm_dtype(num_experts))
            routes_NXK[:, at] = routes_BPLK[b, :n].numpy()
            out[i] = routes_NXK
            if probs_transform is not None:
                probs_NXK = np.zeros(routes_NXK.shape, dtype=np.float32)
                probs_NXK[:, at] = probs_BPLK[b, :n].numpy()
                probs[i] = probs_NXK
            if top_m is not None:
                ids_NXJ = np.zeros((n, num_layers, top_m - routes_BPLK.shape[-1]), dtype=np.int16)
                ids_NXJ[:, at] = more_BPLJ[b, :n].numpy()
                p_NXJ = np.zeros(ids_NXJ.shape, dtype=np.float32)
                p_NXJ[:, at] = more_probs_BPLJ[b, :n].numpy()
                extra_ids[i], extra_probs[i] = ids_NXJ, p_NXJ
    fingerprint = routers_sha256(layers, facts)
    if probs_transform is None:
        return out, fingerprint
    return (out, fingerprint, probs) if top_m is None else (out, fingerprint, probs, (extra_ids, extra_probs))


def next_experts(probs_BPLE: torch.Tensor, routes_BPLK: torch.Tensor, top_m: int):
    """The ``top_m - K`` experts of highest probability outside each token's routed K, in falling probability, and
    their probabilities: ``(ids_BPLJ, probs_BPLJ)``. The routed K come first in the file whatever their
    probabilities (the family's rule may pass over a likelier expert: groups, a correction bias)."""
    J = top_m - routes_BPLK.shape[-1]
    outside_BPLE = probs_BPLE.scatter(-1, routes_BPLK, -1.0)  # the routed ones ranked below every probability
    probs_BPLJ, ids_BPLJ = outside_BPLE.topk(J, dim=-1)
    return ids_BPLJ, probs_BPLJ


def _labelled(data_jsonl, tokenizer_id: str, max_seq_len: int, chat_template_kwargs: dict | None):
    template = ChatTemplate(load_tokenizer(tokenizer_id), chat_template_kwargs)
    rows = scan_rows(data_jsonl, template, max_seq_len, KEEP_TOKENS)  # every bad row refused at once
    return rows, label_range(rows, template, max_seq_len, 0, rows.num_rows), template


def _prepared(model_id, adapter, dtype, probs_transform, top_m, device: str = "auto"):
    """The base model (no LM head), its router facts, and the transform its probabilities are read under; ``top_m``
    checked against its top-k and experts."""
    if top_m is not None and probs_transform is None:
        raise ArgumentError("--top-m stores probabilities beyond the top-k: it goes with --with-probs")
    model, _ = load_base_model(model_id, dtype, adapter, device)  # no LM head: the routes need none
    facts = get_adapter(adapter or model.config.model_type)
    if probs_transform == "family":  # the family's own reading of its router (softmax, or normalised sigmoid)
        probs_transform = family_transform(facts.score_function)
    if top_m is not None:
        spec = router_spec(find_moe_layers(model, facts)[0].router, facts)
        if not spec.top_k <= top_m <= spec.num_experts:
            raise ArgumentError(
                f"--top-m {top_m}: {model_id} routes to {spec.top_k} of {spec.num_experts} experts; the stored "
                f"experts are the routed ones and more, so --top-m runs from {spec.top_k} to {spec.num_experts}"
            )
    return model, facts, probs_transform


def _save(path, model, examples, pad_id, batch_size, adapter, probs_transform, top_m, model_id, data_sha256):
    """One route file of ``examples``: their forward's routes (and probabilities), saved atomically."""
    got = hf_routes(model, examples, pad_id, batch_size, adapter, probs_transform, top_m)
    save_routes(
        path,
        [e.input_ids for e in examples],
        got[0],
        engine=ENGINE,
        routers_sha256=got[1],
        model=str(model_id),
        data_sha256=data_sha256,
        probs=got[2] if probs_transform is not None else None,
        probs_transform=probs_transform,
        extra=got[3] if top_m is not None else None,
    )


#: what ``rpb routes`` records as the routes' producer
ENGINE = "hf generate (rpb routes), vLLM layout"


def write_routes(
    model_id: str,
    data_jsonl: str | Path,
    out_path: str | Path,
    max_seq_len: int,
    batch_size: int = 8,
    tokenizer_id: str | None = None,
    adapter: str | None = None,
    dtype: str = "float32",
    chat_template_kwargs: dict | None = None,
    probs_transform: str | None = None,
    top_m: int | None = None,
) -> int:
    """``rpb routes``: the route file of ``model_id`` over every row of ``data_jsonl``; returns the row count. With
    ``probs_transform`` (``--with-probs``; ``"family"``: the family's own transform) the router probabilities at
    the routed experts are stored too, for ``routing-kd`` from stored routes; with ``top_m`` (``--top-m``) those of
    the next ``top_m - K`` experts by probability too (``top_m`` = the model's experts: the whole distribution)."""
    rows, examples, template = _labelled(data_jsonl, tokenizer_id or model_id, max_seq_len, chat_template_kwargs)
    model, _, probs_transform = _prepared(model_id, adapter, dtype, probs_transform, top_m)
    pad_id = pad_id_of(template.tokenizer)
    _save(out_path, model, examples, pad_id, batch_size, adapter, probs_transform, top_m, model_id, rows.sha256)
    return len(examples)


def write_route_shards(
    model_id: str,
    data_jsonl: str | Path,
    out_dir: str | Path,
    max_seq_len: int,
    chunk_rows: int,
    batch_size: int = 8,
    tokenizer_id: str | None = None,
    adapter: str | None = None,
    dtype: str = "float32",
    chat_template_kwargs: dict | None = None,
    probs_transform: str | None = None,
    top_m: int | None = None,
    device: str = "auto",
) -> int:
    """``rpb routes --chunk-rows N``: the routes as a shard directory (``rpb.replay.routeshards``), ``N`` rows a
    shard, written by ``rpb collect``'s machinery (``rpb.collect.store``): each shard a route file finished whole
    in ``<out>.partial/``, so a rerun after a kill computes only the missing ones; under ``torchrun`` each process
    takes its share. Then the index, and ``<out>.partial/`` becomes ``out_dir``. Returns the row count."""
    tokenizer_id = tokenizer_id or model_id
    template = ChatTemplate(load_tokenizer(tokenizer_id), chat_template_kwargs)
    rows = scan_rows(data_jsonl, template, max_seq_len, KEEP_TOKENS)  # every bad row refused at once
    run = {
        "num_rows": rows.num_rows,
        "data_sha256": rows.sha256,
        "model": str(model_id),
        "tokenizer": tokenizer_id,
        "max_seq_len": max_seq_len,
        "chat_template_kwargs": chat_template_kwargs,
        "probs_transform": probs_transform,
        "top_m": top_m,
        "kind": "routes",
    }
    WorkDir(out_dir, run, chunk_rows).check()  # a mismatched interrupted run is refused before the model loads
    with ranks() as rk:
        at = str(resolve_device(device, rk.local_rank))
        model, facts, transform = _prepared(model_id, adapter, dtype, probs_transform, top_m, at)
        run["routers_sha256"] = routers_sha256(find_moe_layers(model, facts), facts)
        store = WorkDir(out_dir, run, chunk_rows)
        pad_id = pad_id_of(template.tokenizer)
        with missing_chunks(store, rk, "to route") as todo:
            for a, b in todo:
                examples = label_range(rows, template, max_seq_len, a, b)
                _save(
                    store.chunk_path(a, b),
                    model,
                    examples,
                    pad_id,
                    batch_size,
                    adapter,
                    transform,
                    top_m,
                    model_id,
                    rows.sha256,
                )
        if rk.main:
            _finish(store, Path(out_dir))
        rk.barrier()
    return rows.num_rows


def _finish(store: WorkDir, out_dir: Path) -> None:
    """The index written beside the shards, and the work directory put in ``out_dir``'s place."""
    shards = [(store.chunk_path(a, b).name, a, b) for a, b in store.chunks]
    first = load_routes(store.chunk_path(*store.chunks[0])) if store.chunks else None
    write_index(store.path, shards, first.metadata if first else {})
    (store.path / MANIFEST).unlink(missing_ok=True)
    if out_dir.exists():
        shutil.rmtree(out_dir) if out_dir.is_dir() else out_dir.unlink()
    store.path.rename(out_dir)


def write_requests(
    data_jsonl: str | Path,
    out_path: str | Path,
    tokenizer_id: str,
    max_seq_len: int,
    chat_template_kwargs: dict | None = None,
) -> int:
    """``rpb routes --requests``: one JSON line per row, ``{"row": i, "prompt_token_ids": [...]}``, the tokens an
    engine must be sent for the routes to match rpb's labelling; returns the row count."""
    _, examples, _ = _labelled(data_jsonl, tokenizer_id, max_seq_len, chat_template_kwargs)
    lines = [json.dumps({"row": e.index, "prompt_token_ids": list(e.input_ids)}) for e in examples]
    write_text_atomic(out_path, "".join(line + "\n" for line in lines))
    return len(examples)
