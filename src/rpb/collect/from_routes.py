"""``rpb collect --from-routes``: a frequency prior from the routes an inference engine returned for the data's rows.

Shape legend: N = one row's tokens, L = the model's MoE layers, K = top-k, E = routed experts.

Each row is sent to the engine as a prefill-only request of rpb's own token ids (``prompt_token_ids``; one generated
token, never forwarded, so it has no route; prefix caching off, so no token's route is dropped), and comes back
with one route per token: ``[N, layers, K]``. The prior is pi[x, s, l, e] = the share of span s's tokens whose
route in layer l holds e, over K: what ``rpb collect --prior-kind frequency`` computes from an HF forward, here
without one. The model is never loaded: its MoE layers, experts, top-k and router fingerprint are read from the
checkpoint's config and router tensors alone (``rpb.adapters.checkpoint_routers_sha256``), so a 671B base needs
only its config and shards on disk.

Refused before anything is written, every problem at once, each naming its row (line) and what differs: a row
whose tokens are not rpb's labelling of it (the first differing position), a route count other than the token
count, a layer count, top-k or expert id out of the model's range (``rpb.replay.engines.check_routes``, which
maps the engines' every-decoder-layer axis onto the MoE layers, dense layers dropped); a route file whose router
fingerprint or data hash is another model's or file's. An engine's arrays carry no model identity: a file saved
from them without ``routers_sha256`` is checked for shape and token count only.
"""

from __future__ import annotations

import sys
from pathlib import Path

import torch

from rpb.adapters import checkpoint_routers_sha256
from rpb.collect.clip import clip_table, clipped_shares
from rpb.collect.collector import DEFAULT_CHUNK_ROWS
from rpb.collect.record import scan_data
from rpb.collect.rows import label_range
from rpb.collect.store import WorkDir
from rpb.data import Example
from rpb.data.tokens import first_difference
from rpb.errors import ArgumentError
from rpb.models import config_sha256, load_tokenizer
from rpb.prior import NUM_SPANS, selection_sums, span_counts
from rpb.prior.artifact import PriorArtifact, load_artifact
from rpb.replay.engines import check_routes
from rpb.replay.routefile import RouteFile
from rpb.replay.routeshards import open_routes, routes_sha256

#: problems listed in full before the rest are counted
SHOWN_PROBLEMS = 20


class RoutesMismatchError(ArgumentError):
    """A route file that does not belong to this model, data file or labelling (every problem named)."""


def mismatch(header: str, problems: list[str]) -> RoutesMismatchError:
    """The error listing ``problems`` under ``header``: the first ``SHOWN_PROBLEMS`` in full, the rest counted."""
    shown = problems[:SHOWN_PROBLEMS]
    more = f"\n  ... and {len(problems) - len(shown)} more" if len(problems) > len(shown) else ""
    return RoutesMismatchError(f"{header}:\n" + "\n".join(f"  - {p}" for p in shown) + more)


def row_name(index: int, data_file: str) -> str:
    return f"row {index} ({data_file} line {index + 1})"


def row_routes(
    routes: RouteFile, example: Example, model, data_file: str, fused: int = 0
) -> tuple[torch.Tensor | None, list[str]]:
    """``(routes_NLK, problems)`` of one row: its tokens checked against rpb's labelling, then its routes against
    the model (``model``: ``CheckpointRouters`` and ``num_layers``; ``fused``: SGLang's fused shared experts'
    columns after the top-k, dropped)."""
    name = row_name(example.index, data_file)
    sent = routes.tokens(example.index)
    if (at := first_difference(sent, list(example.input_ids))) is not None:
        if at < min(len(sent), len(example.input_ids)):
            where = (
                f"first differing position {at}: the file has token {sent[at]}, rpb's labelling {example.input_ids[at]}"
            )
        else:  # one a prefix of the other: the same rendering cut at another length
            where = (
                f"the file's row is {len(sent)} tokens, rpb's labelling makes {len(example.input_ids)}, the one a "
                "prefix of the other: made at another max_seq_len than this run's? Make the file at the run's"
            )
        made = routes.metadata.get("engine") or "no producer recorded"
        return None, [f"{name}: the route file's tokens ({made}) are not rpb's labelling of the row ({where})"]
    raw_SXK = routes.routes(example.index).numpy()
    if raw_SXK.shape[0] != len(example):
        return None, [
            f"{name}: {raw_SXK.shape[0]} routes for the row's {len(example)} tokens (expected {len(example)}: one "
            "per token, the request's one generated token having none); prefix caching left on, a request cut "
            "short, or routes of another request may cause it"
        ]
    try:
        routes_NLK = check_routes(
            raw_SXK,
            num_tokens=len(example) + 1,  # the request's one generated token, which has no route
            moe_layers=model.moe_layers,
            top_k=model.top_k,
            num_experts=model.num_experts,
            name=name,
            field="routes",
            num_layers=model.num_layers,
            fused_shared_experts=fused,
        )
    except ArgumentError as err:
        return None, [str(err)]
    return routes_NLK, []


def frequency_prior(examples: list[Example], routes_by_row: list[torch.Tensor], num_experts: int):
    """``(prior_NSLE, counts_NS)`` of rows with their ``routes_NLK``: the share of each span's tokens choosing
    each expert, over K."""
    num_layers = routes_by_row[0].shape[1] if routes_by_row else 0
    prior = torch.zeros(len(examples), NUM_SPANS, num_layers, num_experts)
    counts = torch.zeros(len(examples), NUM_SPANS, dtype=torch.int64)
    for i, (ex, ids_NLK) in enumerate(zip(examples, routes_by_row, strict=True)):
        span_1N = torch.tensor([ex.span_ids])
        counts_S = span_counts(span_1N)[0]
        # the layers as a batch: each layer's routes over the row's one span labelling
        sums_LSE = selection_sums(ids_NLK.permute(1, 0, 2), span_1N.expand(num_layers, -1), num_experts)
        prior[i] = sums_LSE.permute(1, 0, 2) / counts_S[:, None, None]
        counts[i] = counts_S
    return prior, counts


class _Model:
    """The checkpoint's facts the routes are checked against."""

    def __init__(self, model_id: str, adapter: str | None):
        from transformers import AutoConfig

        ck = checkpoint_routers_sha256(model_id, adapter)
        config = AutoConfig.from_pretrained(model_id, trust_remote_code=False).get_text_config()
        self.checkpoint, self.config = ck, config
        self.moe_layers, self.num_experts, self.top_k = ck.moe_layers, ck.num_experts, ck.top_k
        self.num_layers = int(config.num_hidden_layers)


def _file_problems(routes: RouteFile, model: _Model, run: dict, routes_path: Path) -> list[str]:
    meta, problems = routes.metadata, []
    if routes.num_rows != run["num_rows"]:
        problems.append(f"{routes_path}: {routes.num_rows} rows of routes for the data file's {run['num_rows']} rows")
    if meta.get("routers_sha256") not in (None, model.checkpoint.routers_sha256):
        problems.append(
            f"{routes_path}: routes of another model: router fingerprint {meta['routers_sha256'][:16]}…, the model's "
            f"{model.checkpoint.routers_sha256[:16]}… (routers_sha256)"
        )
    if meta.get("data_sha256") not in (None, run["data_sha256"]):
        problems.append(f"{routes_path}: routes of another data file (data_sha256 {meta['data_sha256'][:16]}…)")
    return problems


def collect_from_routes(
    model_id: str,
    data_jsonl: str | Path,
    routes_path: str | Path,
    out_path: str | Path,
    max_seq_len: int,
    top_k: int | None = None,
    router_transform: str = "softmax",
    tokenizer_id: str | None = None,
    adapter: str | None = None,
    progress: bool = True,
    chunk_rows: int = DEFAULT_CHUNK_ROWS,
    chat_template_kwargs: dict | None = None,
    fused_shared_experts: int = 0,
) -> PriorArtifact:
    """The frequency prior of ``model_id`` over ``data_jsonl`` from the routes in ``routes_path`` (rpb's route
    file, ``rpb.replay.routefile``), written to ``out_path`` chunk by chunk as ``collect`` writes (resumable).
    ``top_k``, when given, must be the model's; ``fused_shared_experts``: columns after the top-k that an SGLang
    build returns for its fused shared experts (``rpb.replay.engines.check_routes``)."""
    routes_path = Path(routes_path)
    tokenizer_id = tokenizer_id or model_id
    routes = open_routes(routes_path)
    model = _Model(model_id, adapter)
    if top_k is not None and top_k != model.top_k:
        raise ArgumentError(f"--top-k {top_k} does not match the model's own top-k ({model.top_k})")
    scanned = scan_data(
        data_jsonl,
        load_tokenizer(tokenizer_id),
        model_id=model_id,
        tokenizer_id=tokenizer_id,
        max_seq_len=max_seq_len,
        top_k=model.top_k,
        router_transform=router_transform,
        prior_kind="frequency",
        dtype="engine",  # no forward here: the engine chose the precision
        chat_template_kwargs=chat_template_kwargs,
    )
    rows, template, run = scanned.rows, scanned.template, scanned.run
    run |= {
        "model_type": model.checkpoint.model_type,
        "adapter": model.checkpoint.adapter,
        "model_config_sha256": config_sha256(model.config),
        "routers_sha256": model.checkpoint.routers_sha256,
        "moe_layers": model.moe_layers,
        "num_experts": model.num_experts,
        "routes_file": routes_path.name,
        "routes_sha256": routes_sha256(routes_path),
        "routes_engine": routes.metadata.get("engine"),
        "routes_fused_shared_experts": int(fused_shared_experts),
    }
    store = WorkDir(out_path, run, chunk_rows)
    store.check()
    problems = _file_problems(routes, model, run, routes_path)
    if not problems:  # each row's tokens and routes, every row, before anything is written
        for a, b in store.chunks:
            for ex in label_range(rows, template, max_seq_len, a, b):
                problems += row_routes(routes, ex, model, run["data_file"], fused_shared_experts)[1]
    if problems:
        raise mismatch(f"{routes_path}: {len(problems)} problem(s) against {data_jsonl} and {model_id}", problems)
    store.prepare()
    done = store.done()
    for a, b in (c for c in store.chunks if c not in done):
        examples = label_range(rows, template, max_seq_len, a, b)
        by_row = [row_routes(routes, ex, model, run["data_file"], fused_shared_experts)[0] for ex in examples]
        prior, counts = frequency_prior(examples, by_row, model.num_experts)
        store.write_chunk(a, b, prior, counts, rows.row_sha256(a, b))
    store.assemble(run, len(model.moe_layers), model.num_experts, rows.digests)
    store.remove()
    artifact = load_artifact(out_path)
    if progress:
        print(clip_table(clipped_shares(artifact.prior_qa), run["moe_layers"], "frequency"), file=sys.stderr)
    return artifact
