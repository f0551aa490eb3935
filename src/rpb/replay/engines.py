"""Routes as an inference engine returns them, turned into rpb's own ``routes_SLK``.

Shape legend: S = one rollout's routed positions (its ``num_tokens - 1`` tokens, the last one never being
forwarded), X = the engine's layer axis, L = the model's MoE layers (in model order; dense layers excluded),
K = top-k.

``routes_SLK`` (one rollout: a prompt and its completion, ``num_tokens`` tokens in all) is a ``torch.int64``
tensor of shape ``[num_tokens - 1, L, K]``: row s holds the top-k expert ids (any order) chosen at token position
s in each MoE layer. It is what ``rollout_routes`` / ``batch_routes`` (``routes``) carry for one rollout.

What the engines return, as read in their sources (vLLM 0.34.0 and SGLang 0.5.23 wheels; no live engine has been
run against this module, so these facts are the sources' word, checked here only against inputs built the way
those sources build them):

* vLLM (``enable_return_routed_experts=True``): ``CompletionOutput.routed_experts`` (vllm/outputs.py:92), one per
  completion of a ``RequestOutput``; a numpy array ``[num_tokens - 1, num_hidden_layers, top_k]`` (the OpenAI
  server's docstring, vllm/entrypoints/openai/completion/protocol.py:691-700), of dtype uint8 when the model has
  at most 256 experts and uint16 otherwise
  (vllm/model_executor/layers/fused_moe/routed_experts_capturer.py:84). Its layer axis counts every decoder layer
  (``num_hidden_layers``, routed_experts_capturer.py:47-49); each MoE layer writes at its own decoder-layer index
  (routed_experts_capturer.py:106-118, ``layer_id`` from the module name), so a dense layer (DeepSeek-V3's first
  ``first_k_dense_replace``) keeps the zeros it was allocated with (routed_experts_capturer.py:95). Prompt tokens
  are included: the rows cover ``[routed_experts_prompt_start, num_tokens - 1)``, the start 0 by default
  (vllm/sampling_params.py:443; vllm/distributed/aux_output_connector/connector.py:102-108 and 197-214). The
  OpenAI-compatible server sends it per choice (``ChatCompletionResponseChoice`` / ``CompletionResponseChoice``,
  field ``routed_experts``) as base64 of the ``.npy`` bytes (vllm/utils/serial_utils.py:67-71).
* SGLang (``--enable-return-routed-experts`` and ``return_routed_experts=True`` per request):
  ``meta_info["routed_experts"]``, base64 of the raw int32 bytes of a ``[num_tokens - 1, num_hidden_layers,
  top_k]`` tensor, which decodes flat (sglang/srt/managers/detokenizer_manager.py:432-448,
  sglang/srt/managers/tokenizer_manager.py:2602-2609, sglang/srt/state_capturer/routed_experts.py:166-174). The
  layer axis counts every decoder layer (``hf_text_config.num_hidden_layers``, routed_experts.py:72-73), each MoE
  layer writing at its ``layer_id`` (sglang/srt/state_capturer/base.py:48-50); a dense layer keeps zeros
  (base.py:38-42). Prompt tokens are included: rows ``[routed_experts_start_len, seqlen - 1)``, the start 0 by
  default (base.py:173-188; sglang/srt/managers/scheduler_components/batch_result_processor.py:136-161). The
  OpenAI-compatible server sends the same string as ``sglext.routed_experts``
  (sglang/srt/entrypoints/openai/protocol.py:470-477).

A build that returns SGLang's fused shared experts' columns after the top-k (ids at ``num_experts`` and up, or -1)
has them dropped when their count is given (``fused_shared_experts``; checked, never guessed: an id past the
experts is otherwise an error). Both take the ids from the router's top-k, so a row's k ids are
distinct; a row that repeats one is refused (it is
what a dense layer wrongly listed among the MoE layers reads as: all zeros).
"""

from __future__ import annotations

import base64
import binascii
import io
import itertools

import numpy as np
import torch

from rpb.errors import ArgumentError

#: the field each engine's routes arrive in, as a refusal names it
VLLM_FIELD = "vLLM routed_experts"
SGLANG_FIELD = "SGLang meta_info['routed_experts']"

#: why a rollout's route count can differ from its tokens' less one
COUNT_CAUSES = (
    "a prompt start above 0 (routed_experts_prompt_start / routed_experts_start_len), prefix caching in an engine "
    "that drops cached tokens' routes, or a truncated or aborted request may cause it"
)


def routes_from_vllm(
    routed_experts,
    *,
    num_tokens: int,
    moe_layers,
    top_k: int,
    num_experts: int,
    name: str,
    num_layers: int | None = None,
) -> torch.Tensor:
    """``routes_SLK`` from what vLLM returns for one completion.

    ``routed_experts``: ``CompletionOutput.routed_experts`` (a numpy array ``[num_tokens - 1, num_hidden_layers,
    top_k]``), the same as a nested list, or the OpenAI server's base64 ``.npy`` string. ``moe_layers``: the
    decoder-layer indices of the model's MoE layers, in model order. ``num_layers``: the model's decoder-layer count
    (``num_hidden_layers``; by default one past the last MoE layer). ``name`` names the rollout in a refusal."""
    _check_arguments(num_tokens, moe_layers, top_k, num_experts, name, num_layers)
    if routed_experts is None:
        raise ArgumentError(f"{name}: no {VLLM_FIELD} (enable_return_routed_experts off, or the request aborted)")
    if isinstance(routed_experts, (str, bytes)):
        raw = _npy_from_base64(routed_experts, name)
    else:
        raw = _as_array(routed_experts, name, VLLM_FIELD)
    return check_routes(
        raw,
        num_tokens=num_tokens,
        moe_layers=moe_layers,
        top_k=top_k,
        num_experts=num_experts,
        name=name,
        field=VLLM_FIELD,
        num_layers=num_layers,
    )


def routes_from_sglang(
    routed_experts,
    *,
    num_tokens: int,
    moe_layers,
    top_k: int,
    num_experts: int,
    name: str,
    num_layers: int | None = None,
) -> torch.Tensor:
    """``routes_SLK`` from what SGLang returns for one request.

    ``routed_experts``: ``meta_info["routed_experts"]`` (base64 of int32 bytes, ``[num_tokens - 1,
    num_hidden_layers, top_k]`` flattened), or that decoded: a flat int32 array (as SGLang's own
    ``extract_routed_experts_from_meta_info`` gives it) or one already shaped ``[rows, layers, top_k]``. The other
    arguments as for ``routes_from_vllm``; the flat form is split into rows of ``num_layers`` x ``top_k``."""
    _check_arguments(num_tokens, moe_layers, top_k, num_experts, name, num_layers)
    if routed_experts is None:
        raise ArgumentError(
            f"{name}: no {SGLANG_FIELD} (return_routed_experts off for the request or the server, or it aborted)"
        )
    if isinstance(routed_experts, (str, bytes)):
        raw = _int32_from_base64(routed_experts, name)
    else:
        raw = _as_array(routed_experts, name, SGLANG_FIELD)
    if raw.ndim == 1:
        raw = _split_flat(raw, num_tokens, _decoder_layers(moe_layers, num_layers), len(moe_layers), top_k, name)
    return check_routes(
        raw,
        num_tokens=num_tokens,
        moe_layers=moe_layers,
        top_k=top_k,
        num_experts=num_experts,
        name=name,
        field=SGLANG_FIELD,
        num_layers=num_layers,
    )


def check_routes(
    raw_SXK,
    *,
    num_tokens: int,
    moe_layers,
    top_k: int,
    num_experts: int,
    name: str,
    field: str,
    num_layers: int | None = None,
    fused_shared_experts: int = 0,
) -> torch.Tensor:
    """``routes_SLK`` from an engine's ``[rows, layers, top_k]`` integer array, every problem refused at once.
    ``fused_shared_experts``: the columns past top-k that hold fused shared experts' slots (dropped once checked).

    The layer axis may hold every decoder layer (``num_layers`` of them; the MoE ones are kept) or the MoE layers
    only. Refused, naming ``name`` and ``field``: a row count other than ``num_tokens - 1``, a layer count or top-k
    that does not fit, an expert id outside ``[0, num_experts)``, a row repeating an id within its top-k."""
    _check_arguments(num_tokens, moe_layers, top_k, num_experts, name, num_layers)
    raw_SXK = np.asarray(raw_SXK)
    if raw_SXK.dtype.kind not in "iu":
        raise ArgumentError(f"{name}: {field} has dtype {raw_SXK.dtype}, not integer expert ids")
    if raw_SXK.ndim != 3:
        raise ArgumentError(
            f"{name}: {field} has shape {raw_SXK.shape}, not [routes, layers, top_k] (expected "
            f"[{num_tokens - 1}, {_decoder_layers(moe_layers, num_layers)} or {len(moe_layers)}, {top_k}])"
        )
    moe_layers = [int(i) for i in moe_layers]
    layers = _decoder_layers(moe_layers, num_layers)
    rows, width, k = raw_SXK.shape
    problems = []
    if rows != num_tokens - 1:
        problems.append(
            f"{rows} routes for {num_tokens} tokens (expected {num_tokens - 1}: one per token but the last); "
            + COUNT_CAUSES
        )
    # which engine layer each kept layer is, and the decoder layer it names in a message
    if width == layers:
        picked, labels = moe_layers, moe_layers
    elif width == len(moe_layers):
        picked, labels = list(range(width)), moe_layers
    else:
        picked, labels = list(range(width)), list(range(width))
        problems.append(
            f"{width} layers (expected {layers} decoder layers, or the {len(moe_layers)} MoE layers "
            f"{_short(moe_layers)} alone)"
        )
    if fused_shared_experts:
        if k != top_k + fused_shared_experts:
            problems.append(f"top-{k} ids per layer (expected top-{top_k} + {fused_shared_experts} fused shared)")
        elif not _fused_shared_columns(raw_SXK[:, picked, top_k:], num_experts):
            problems.append(
                f"the last {fused_shared_experts} column(s) hold routed experts' ids, not fused shared experts' "
                f"(ids from {num_experts} on, or -1)"
            )
        k, raw_SXK = top_k, raw_SXK[..., :top_k]
    if k != top_k:
        problems.append(f"top-{k} ids per layer (expected top-{top_k})")
    ids_SLK = raw_SXK[:, picked, :].astype(np.int64)
    problems += _id_problems(ids_SLK, labels, num_experts)
    if problems:
        raise ArgumentError(
            f"{name}: {field} of shape {tuple(raw_SXK.shape)} does not fit: {len(problems)} problem(s):\n"
            + "\n".join(f"  - {p}" for p in problems)
        )
    return torch.from_numpy(np.ascontiguousarray(ids_SLK))


def _fused_shared_columns(extra_SXJ: np.ndarray, num_experts: int) -> bool:
    """Whether the columns past top-k hold fused shared experts' slots: SGLang sizes its device buffer
    ``num_experts_per_tok + num_fused_shared_experts`` wide (sglang/srt/state_capturer/routed_experts.py:85-92;
    0.5.23 returns the first ``num_experts_per_tok`` alone, lines 136-148), the extra columns holding the shared
    experts' ids (at ``num_experts`` and up) or -1 where a capture passed routed ids only (lines 109-121). Never
    a routed expert's id."""
    return extra_SXJ.size > 0 and bool(((extra_SXJ < 0) | (extra_SXJ >= num_experts)).all())


def _id_problems(ids_SLK: np.ndarray, labels: list[int], num_experts: int) -> list[str]:
    """Expert ids outside ``[0, num_experts)``, and rows repeating an id (each found at its first place)."""
    problems = []
    bad_SLK = (ids_SLK < 0) | (ids_SLK >= num_experts)
    if bad_SLK.any():
        s, m, j = (int(i) for i in np.argwhere(bad_SLK)[0])
        problems.append(
            f"{int(bad_SLK.sum())} expert id(s) outside [0, {num_experts}) (the first: {int(ids_SLK[s, m, j])} at "
            f"position {s}, layer {labels[m]})"
        )
    if ids_SLK.shape[-1] > 1 and ids_SLK.size:
        sorted_SLK = np.sort(ids_SLK, axis=-1)
        repeat_SL = (sorted_SLK[..., 1:] == sorted_SLK[..., :-1]).any(axis=-1)
        if repeat_SL.any():
            s, m = (int(i) for i in np.argwhere(repeat_SL)[0])
            problems.append(
                f"{int(repeat_SL.sum())} row(s) repeating an expert id within their top-{ids_SLK.shape[-1]} (the "
                f"first: {ids_SLK[s, m].tolist()} at position {s}, layer {labels[m]}; a dense layer listed among "
                "the MoE layers reads as all zeros)"
            )
    return problems


def _split_flat(flat: np.ndarray, num_tokens: int, layers: int, moe: int, top_k: int, name: str) -> np.ndarray:
    """SGLang's flat ids as ``[rows, layers, top_k]``: rows of every decoder layer (what SGLang sends), or of the MoE
    layers alone where that, and not the other, makes exactly ``num_tokens - 1`` rows."""
    width = layers
    if flat.size != (num_tokens - 1) * layers * top_k and flat.size == (num_tokens - 1) * moe * top_k:
        width = moe
    if flat.size % (width * top_k):
        raise ArgumentError(
            f"{name}: {SGLANG_FIELD} holds {flat.size} ids, not a whole number of rows of {layers} layers x "
            f"{top_k} (expected {(num_tokens - 1) * layers * top_k} for {num_tokens} tokens)"
        )
    return flat.reshape(-1, width, top_k)


def _check_arguments(num_tokens, moe_layers, top_k, num_experts, name, num_layers) -> None:
    """Refuse a call whose description of the model or rollout cannot be right (not the engine's data)."""
    problems = []
    if num_tokens < 1:
        problems.append(f"num_tokens {num_tokens} (a rollout has at least one token)")
    layers = [int(i) for i in moe_layers]
    if not layers:
        problems.append("moe_layers is empty (a model without MoE layers has no routes)")
    elif layers[0] < 0 or any(b <= a for a, b in itertools.pairwise(layers)):
        problems.append(f"moe_layers {_short(layers)} are not distinct non-negative indices in model order")
    elif num_layers is not None and layers[-1] >= num_layers:
        problems.append(f"moe_layers {_short(layers)} reach past the model's {num_layers} decoder layers")
    if top_k < 1 or num_experts < top_k:
        problems.append(f"top_k {top_k} of num_experts {num_experts} (expected 1 <= top_k <= num_experts)")
    if problems:
        raise ArgumentError(f"{name}: " + "; ".join(problems))


def _decoder_layers(moe_layers, num_layers: int | None) -> int:
    """The decoder-layer count of the engine's layer axis: ``num_layers``, else one past the last MoE layer."""
    return num_layers if num_layers is not None else int(moe_layers[-1]) + 1


def _short(values: list[int]) -> str:
    """A list of layer indices, shortened to its ends when long."""
    return str(values) if len(values) <= 6 else f"[{values[0]}, {values[1]}, ..., {values[-1]}] ({len(values)})"


def _as_array(value, name: str, field: str) -> np.ndarray:
    """An array, nested list or tensor as a numpy array (a ragged list refused)."""
    if isinstance(value, torch.Tensor):
        value = value.detach().cpu()
    try:
        return np.asarray(value)
    except ValueError as exc:
        raise ArgumentError(f"{name}: {field} is not a rectangular array of ids ({exc})") from None


def _b64_bytes(text, name: str, field: str) -> bytes:
    """The bytes a base64 string holds, its alphabet checked."""
    try:
        return base64.b64decode(text, validate=True)
    except (binascii.Error, ValueError) as exc:
        raise ArgumentError(f"{name}: {field} is not base64 ({exc})") from None


def _npy_from_base64(text, name: str) -> np.ndarray:
    """vLLM's OpenAI server's encoding: base64 of the ``.npy`` bytes (``numpy2base64``); object arrays refused."""
    payload = _b64_bytes(text, name, VLLM_FIELD)
    try:
        return np.load(io.BytesIO(payload), allow_pickle=False)
    except (ValueError, OSError, EOFError) as exc:
        raise ArgumentError(f"{name}: {VLLM_FIELD} is not a base64 .npy array ({exc})") from None


def _int32_from_base64(text, name: str) -> np.ndarray:
    """SGLang's encoding: base64 of a tensor's raw int32 bytes (``tensor.numpy().tobytes()``, little-endian on the
    machines it runs on), flat."""
    payload = _b64_bytes(text, name, SGLANG_FIELD)
    if len(payload) % 4:
        raise ArgumentError(f"{name}: {SGLANG_FIELD} holds {len(payload)} bytes, not whole int32 ids")
    return np.frombuffer(payload, dtype="<i4")
