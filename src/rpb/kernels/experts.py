"""A CPU experts implementation for transformers' MoE blocks, registered as ``"rpb_sorted"``.

transformers 5 runs a MoE block's experts through an interface (``experts_implementation``); on CPU its
default, ``grouped_mm``, builds every step from a dozen autograd nodes over the (token, expert) assignments
(gather, weight, unpermute, and their backward's zero-fills and scatters). ``rpb_sorted`` is one autograd
function for the whole block: the assignments are sorted by expert once, the two projections are torch's
grouped matrix products over the sorted rows (forward, and backward for inputs and weights), and each
token's sum over its experts is one ``index_add_`` (deterministic on CPU). It can also skip tokens that
carry nothing: under ``token_mask(model)`` the rows whose attention mask is 0 (padding) get no expert work
and a zero expert output. Such rows are read by no other position (they are masked keys) and must carry no
loss, which is what a padded causal-LM batch is.

It acts on CPU float32 / bfloat16 / float16 experts with concatenated ``gate_up_proj`` [E, 2I, H] and
``down_proj`` [E, H, I], no biases, no post-expert norm (DeepSeek-V2/V3, Kimi, GLM-4.5, Qwen2/3-MoE,
Mixtral, OLMoE, ...); other layouts and devices run transformers' ``grouped_mm``; other dtypes (float64) and
sizes torch's grouped_mm cannot stride (not a multiple of 16 bytes) the module's own per-expert loop
(``eager``), as if they had been asked for. The gate
(the module's own ``_apply_gate``) is recomputed in the backward, so any activation works.

Shape legend: T tokens, K experts per token, E experts, H hidden, I expert intermediate, X = 2I, S assignments
kept (T*K without a token mask).
"""

from __future__ import annotations

import contextlib
from contextvars import ContextVar

import torch
from torch.nn.functional import grouped_mm
from transformers.integrations.moe import ALL_EXPERTS_FUNCTIONS, grouped_mm_experts_forward

NAME = "rpb_sorted"
#: what torch's CPU grouped_mm multiplies
_DTYPES = (torch.float32, torch.bfloat16, torch.float16)

#: the flattened [B*T] bool mask of the tokens whose expert output is needed (None: every token)
_KEEP_T: ContextVar[torch.Tensor | None] = ContextVar("rpb_expert_token_mask", default=None)


def registered() -> list[str]:
    """Every experts implementation transformers will take by name (its own and rpb's)."""
    return ["eager", *sorted(ALL_EXPERTS_FUNCTIONS.keys())]


def supports(experts: torch.nn.Module) -> bool:
    """Whether ``experts`` has the weight layout ``rpb_sorted`` multiplies (else it runs ``grouped_mm``)."""
    flags = (getattr(experts, "has_gate", False), getattr(experts, "is_concatenated", True))
    off = (
        getattr(experts, "has_bias", False),
        getattr(experts, "is_transposed", False),
        getattr(experts, "has_post_expert_norm", False),
        getattr(experts, "_is_expert_parallel", False),
    )
    return all(flags) and not any(off) and hasattr(experts, "gate_up_proj") and hasattr(experts, "down_proj")


class _SortedExperts(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x_TH, idx_TK, w_TK, gate_up_EXH, down_EHI, keep_T, apply_gate):
        T, K = idx_TK.shape
        E, H = down_EHI.shape[0], x_TH.shape[1]
        flat_S = idx_TK.reshape(-1)
        if keep_T is None:
            order_S = torch.argsort(flat_S, stable=True)
        else:
            kept = keep_T.repeat_interleave(K).nonzero().squeeze(1)
            order_S = kept[torch.argsort(flat_S[kept], stable=True)]
        counts_E = torch.bincount(flat_S[order_S], minlength=E)
        tok_S = order_S // K
        xs_SH = x_TH.index_select(0, tok_S)
        offs_E = torch.cumsum(counts_E, 0).to(torch.int32)
        h_SX = grouped_mm(xs_SH, gate_up_EXH.transpose(1, 2), offs=offs_E)
        act_SI = apply_gate(h_SX)
        y_SH = grouped_mm(act_SI, down_EHI.transpose(1, 2), offs=offs_E)
        ws_S = w_TK.reshape(-1).index_select(0, order_S).to(y_SH.dtype)
        # each token's sum over its experts, accumulated in the sorted order (CPU index_add_ is deterministic)
        out_TH = x_TH.new_zeros(T, H).index_add_(0, tok_S, y_SH * ws_S[:, None])
        ctx.save_for_backward(x_TH, gate_up_EXH, down_EHI, order_S, tok_S, h_SX, y_SH, ws_S, offs_E)
        ctx.apply_gate, ctx.w_dtype, ctx.TK = apply_gate, w_TK.dtype, (T, K)
        return out_TH

    @staticmethod
    def backward(ctx, dout_TH):
        x_TH, gate_up_EXH, down_EHI, order_S, tok_S, h_SX, y_SH, ws_S, offs_E = ctx.saved_tensors
        T, K = ctx.TK
        dy_SH = dout_TH.index_select(0, tok_S)
        dw_TK = dout_TH.new_zeros(T * K, dtype=ctx.w_dtype)
        dw_TK[order_S] = (dy_SH * y_SH).sum(-1).to(ctx.w_dtype)  # a dropped assignment's weight gets 0
        dy_SH.mul_(ws_S[:, None])
        with torch.enable_grad():
            h_req = h_SX.detach().requires_grad_(True)
            act_SI = ctx.apply_gate(h_req)
        dact_SI = grouped_mm(dy_SH, down_EHI, offs=offs_E)
        ddown_EHI = grouped_mm(dy_SH.t(), act_SI.detach(), offs=offs_E)  # an expert without rows gets zeros
        (dh_SX,) = torch.autograd.grad(act_SI, h_req, dact_SI)
        xs_SH = x_TH.index_select(0, tok_S)
        dxs_SH = grouped_mm(dh_SX, gate_up_EXH, offs=offs_E)
        dgate_up_EXH = grouped_mm(dh_SX.t(), xs_SH, offs=offs_E)
        dx_TH = x_TH.new_zeros(T, x_TH.shape[1]).index_add_(0, tok_S, dxs_SH)
        return dx_TH, None, dw_TK.view(T, K), dgate_up_EXH, ddown_EHI, None, None


def _aligned(*weights: torch.Tensor) -> bool:
    """torch's CPU grouped_mm wants 16-byte strides and starts (hidden and intermediate sizes that are
    multiples of 4 in float32, of 8 in 16-bit floats; a memory-mapped checkpoint may start anywhere)."""
    return all(w.data_ptr() % 16 == 0 and all(d * w.element_size() % 16 == 0 for d in w.shape[1:]) for w in weights)


def sorted_experts_forward(self, hidden_states, top_k_index, top_k_weights):
    """transformers' experts interface: ``experts(hidden_states [T, H], top_k_index [T, K], top_k_weights
    [T, K]) -> [T, H]``."""
    if not supports(self) or hidden_states.device.type != "cpu":
        return grouped_mm_experts_forward(self, hidden_states, top_k_index, top_k_weights)
    if hidden_states.dtype not in _DTYPES or not _aligned(self.gate_up_proj, self.down_proj):
        # torch's grouped_mm multiplies neither: the module's own per-expert loop
        return type(self).forward.__wrapped__(self, hidden_states, top_k_index, top_k_weights)
    keep_T = _KEEP_T.get()
    if keep_T is not None and (keep_T.numel() != hidden_states.shape[0] or not keep_T.any()):
        keep_T = None  # not this forward's tokens (a nested or unrelated model call), or none to keep
    out_TH = _SortedExperts.apply(
        hidden_states, top_k_index, top_k_weights, self.gate_up_proj, self.down_proj, keep_T, self._apply_gate
    )
    return out_TH.to(hidden_states.dtype)


ALL_EXPERTS_FUNCTIONS.register(NAME, sorted_experts_forward)


class TokenMask:
    """Hooks on a causal LM that hand its attention mask to ``rpb_sorted`` for the duration of each forward:
    the experts then skip the masked tokens. ``remove()`` takes the hooks off."""

    def __init__(self, model: torch.nn.Module):
        self._tokens = []
        self._hooks = [
            model.register_forward_pre_hook(self._enter, with_kwargs=True),
            model.register_forward_hook(self._leave, always_call=True),
        ]

    def _enter(self, module, args, kwargs):
        mask = kwargs.get("attention_mask")
        ids = kwargs.get("input_ids", args[0] if args else None)
        shape = ids.shape if ids is not None else kwargs["inputs_embeds"].shape[:2]
        keep = None
        if mask is not None and mask.dim() == 2 and mask.shape[0] == shape[0] and mask.shape[1] >= shape[1]:
            keep = mask[:, -shape[1] :].reshape(-1).bool()  # with a cache the mask also covers the past
        self._tokens.append(_KEEP_T.set(keep))

    def _leave(self, module, args, output):
        if self._tokens:
            _KEEP_T.reset(self._tokens.pop())

    def remove(self) -> None:
        for hook in self._hooks:
            hook.remove()
        self._hooks = []


@contextlib.contextmanager
def token_mask(model: torch.nn.Module):
    """``with token_mask(model): ...``: the experts of ``model`` skip the tokens its attention mask masks."""
    handle = TokenMask(model)
    try:
        yield handle
    finally:
        handle.remove()
