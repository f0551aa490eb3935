"""The routing monitor: the base's routers frozen, the current ones compared with them token by token.

Shape legend: T = tokens of one router call, H = hidden size, E = routed experts, K = top-k.

Per MoE layer and logging window, over the loss tokens (``labels != -100``; the tokens of a mask given with
``RoutingMonitor.tokens``; every attended token when a forward has neither, said once in the log), on the
hidden states the current model feeds each router:

* ``topk_overlap``: |current top-k ∩ base top-k| / k, both chosen by the family's own rule (groups and the
  expert-correction bias included, no rpb bias: what each router itself would pick);
* ``kl``: KL(base ‖ current) of the run's router transform (``MonitorConfig.router_transform``, else the
  anchor's -- the one its ``kl-to-base`` minimises --, else the family's: ``rpb.anchors.transform``), in nats;
* ``load_cv``, ``max_share``, ``dead_fraction``, ``entropy``: the current selection's load per expert
  (coefficient of variation, the largest share, the share of experts never chosen, and the entropy of the
  shares over log E).

Those read the *router's* drift: both selections on the current hidden states. Where the step has the base's own
forward at hand (``routing-kd`` from the online base, or GRPO's reference model: the step context's
``TokenContext.base``), two more read the *routing's* drift, the base's routing on its own hidden states against
the current model's on its own, what ``rpb retention`` reports after training:

* ``base_forward_topk_overlap`` and ``base_forward_kl``, as above but with the base's selection and distribution
  from the base's own forward.
"""

from __future__ import annotations

import contextlib
import logging
import math
from dataclasses import dataclass, field

import torch
from torch.nn import functional

from rpb.adapters import RouterFacts, find_moe_layers, get_adapter, router_spec
from rpb.adapters.hf import expert_bias_of
from rpb.anchors import AnchorHandle
from rpb.errors import ArgumentError
from rpb.observe.hooks import Hooks, RouterCall, on_model_inputs, on_router_calls
from rpb.prior import ROUTER_TRANSFORMS, family_transform, router_probs
from rpb.routing import select

FIGURES = ("topk_overlap", "kl", "load_cv", "max_share", "dead_fraction", "entropy")
#: the routing's drift, where the step carries the base's own forward (module doc)
BASE_FORWARD_FIGURES = ("base_forward_topk_overlap", "base_forward_kl")

logger = logging.getLogger("rpb.monitor")


@dataclass
class MonitorConfig:
    #: a trainer's monitor (``rpb train``'s ``monitor:``, rpb's TRL trainers, the axolotl plugin): None, on where
    #: the base's routing is at hand (``routing-kd``: its online base or stored routes), so the routing's drift is
    #: logged with no configuration; True, on; False, off. ``attach_monitor`` attaches whatever it says
    enabled: bool | None = None
    #: observe one step in every this many (1: every step); the others run untouched
    every_n_steps: int = 1
    #: also log routing/layer_<i>/<figure> for every MoE layer (default: mean, min, max over layers)
    per_layer: bool = False
    #: alarms (None: off): a layer's overlap with the base below this ...
    min_overlap: float | None = None
    #: ... a layer's share of dead experts above this ...
    max_dead_fraction: float | None = None
    #: ... the mean KL rising by more than this from one window to the next
    max_kl_jump: float | None = None
    #: an alarm stops training (the Trainer's ``should_training_stop``); otherwise it warns and logs
    stop_on_alarm: bool = False
    #: the KL's transform, "softmax" or "sigmoid-normalized" (None: the anchor's, else the family's)
    router_transform: str | None = None


@dataclass
class _Window:
    tokens: torch.Tensor  # [L] float64
    overlap: torch.Tensor  # [L]
    kl: torch.Tensor  # [L]
    counts_LE: torch.Tensor  # [L, E]
    #: the base's own forward against the current one (``BASE_FORWARD_FIGURES``): tokens, overlap and KL sums
    own_LF: torch.Tensor | None = None  # [L, 3]


@dataclass
class RoutingMonitor:
    """Attach to a model whose routers are still the base's; ``flush()`` returns the window's figures."""

    model: torch.nn.Module
    config: MonitorConfig = field(default_factory=MonitorConfig)
    adapter: str | None = None
    #: an rpb anchor installed in ``model``: the monitor reads the routers through its taps (no hooks of its own
    #: on them) and keeps its own window (the anchor resets its counters at
    #: every log, the monitor at every flush)
    anchor: AnchorHandle | None = None
    #: count training-mode forwards only (the Trainer's callback: an evaluation inside a window stays out)
    training_only: bool = False

    def __post_init__(self):
        self.facts: RouterFacts = get_adapter(self.adapter or self.model.config.model_type)
        self.layers = find_moe_layers(self.model, self.facts)
        self.base = [self._frozen(m) for m in self.layers]
        self.transform = self._transform()
        self.active = True
        self._mask_T: torch.Tensor | None = None
        self._mask_source: str | None = None  # "labels", "given", "attention" or None (every token)
        self._given_BT: torch.Tensor | None = None
        self._said_unlabelled = False
        #: the last flush's figures per layer: {figure: {decoder layer index: value}} (the alarms name layers)
        self.last_layers: dict[str, dict[int, float]] = {}
        self._hooks: list[Hooks] = []
        self._last_kl: float | None = None
        self._reset()

    def _transform(self) -> str:
        own, anchor = self.config.router_transform, self.anchor.router_transform if self.anchor else None
        if own is not None and own not in ROUTER_TRANSFORMS:
            raise ArgumentError(f"MonitorConfig.router_transform: one of {ROUTER_TRANSFORMS}, got {own!r}")
        if own is not None and anchor is not None and own != anchor:
            logger.warning("rpb monitor: KL read as %s, while the anchor's kl-to-base reads %s", own, anchor)
        return own or anchor or family_transform(self.facts.score_function)

    def _frozen(self, layer) -> dict:
        """The base router's weight, its own bias and the expert-correction bias, copied whole (never trained)."""
        router = layer.router
        bias = getattr(router, self.facts.router_bias) if self.facts.router_bias else None
        spec = router_spec(router, self.facts)
        weight = _whole(router.weight)
        if weight.dim() != 2 or weight.shape[0] != spec.num_experts:
            raise ArgumentError(
                f"router {layer.name}'s weight has shape {tuple(weight.shape)} here, not [experts, hidden]: it is "
                "sharded by FSDP1 (flat parameters). Attach the monitor before wrapping, or use FSDP2 "
                '(fsdp_config {"version": 2}), whose shards the monitor gathers'
            )
        return {
            "weight": weight,
            "bias": _whole(bias),
            "expert_bias": _whole(expert_bias_of(layer, self.facts)),
            "spec": spec,
        }

    def _reset(self) -> None:
        L, E = len(self.layers), self.base[0]["weight"].shape[0]
        zeros = lambda *s: torch.zeros(*s, dtype=torch.float64)  # noqa: E731
        self.window = _Window(zeros(L), zeros(L), zeros(L), zeros(L, E), zeros(L, 3))

    # ---- hooks ---------------------------------------------------------------------------------------
    def attach(self) -> RoutingMonitor:
        if self._hooks:
            return self
        self._hooks.append(on_model_inputs(self.model, self._read_mask))
        if self.anchor is not None:
            self.anchor.taps.append(self._tap)
            return self
        self._hooks.append(on_router_calls(self.layers, self._observer))
        return self

    def remove(self) -> None:
        for h in self._hooks:
            h.remove()
        self._hooks = []
        if self.anchor is not None and self._tap in self.anchor.taps:
            self.anchor.taps.remove(self._tap)

    @contextlib.contextmanager
    def tokens(self, mask_BT: torch.Tensor):
        """Observe only the tokens where ``mask_BT`` ([batch, tokens] bool, the forward's ``input_ids``
        shape) is true, in every forward inside the block, labels or not: e.g. a GRPO step's completion
        tokens, whose forward carries no labels. Outside the block the labels choose again."""
        if mask_BT.dim() != 2:
            raise ArgumentError(f"RoutingMonitor.tokens: a [batch, tokens] mask, got shape {tuple(mask_BT.shape)}")
        self._given_BT = mask_BT.bool()
        try:
            yield self
        finally:
            self._given_BT = None

    def _read_mask(self, args, kwargs):
        labels, attention = kwargs.get("labels"), kwargs.get("attention_mask")
        ids = kwargs.get("input_ids", args[0] if args else None)
        if self._given_BT is not None:
            if isinstance(ids, torch.Tensor) and tuple(ids.shape) != tuple(self._given_BT.shape):
                raise ArgumentError(
                    f"RoutingMonitor.tokens: the mask has shape {tuple(self._given_BT.shape)}, the forward's "
                    f"input_ids {tuple(ids.shape)}"
                )
            self._mask_T, self._mask_source = self._given_BT.reshape(-1), "given"
        elif labels is not None:
            self._mask_T, self._mask_source = (labels != -100).reshape(-1), "labels"
        elif attention is not None and attention.dim() == 2:
            self._mask_T, self._mask_source = attention.bool().reshape(-1), "attention"
        else:
            self._mask_T, self._mask_source = None, None

    def _observer(self, call: RouterCall) -> None:
        if self.active and (call.module.training or not self.training_only):
            with torch.no_grad():
                logits_TE, _, _ = call.read()
                self._observe(call.pos, call.hidden, logits_TE)

    def _tap(self, pos: int, hidden, logits_TE, native_ids_TK) -> None:
        if self.active:  # the anchor taps training-mode forwards only
            with torch.no_grad():
                self._observe(pos, hidden, logits_TE)
                ctx = self.anchor._context
                if ctx is not None and ctx.base is not None and ctx.base.logits_LTE is not None:
                    self._observe_base_forward(pos, logits_TE, ctx.base)

    def _observe_base_forward(self, pos: int, logits_TE, base) -> None:
        """The base's routing on its own hidden states (``base``: the step's ``BaseRouting``) against this router
        call's, on the tokens the window counts and the base routing covers."""
        layer, frozen = self.layers[pos], self.base[pos]
        logits_TE = logits_TE.reshape(-1, logits_TE.shape[-1])
        base_TE = base.logits_LTE[pos].to(logits_TE.device)
        keep_T = torch.ones(logits_TE.shape[0], dtype=torch.bool, device=logits_TE.device)
        if self._mask_T is not None and self._mask_T.numel() == keep_T.numel():
            keep_T &= self._mask_T.to(keep_T.device)
        if base.known_T is not None:
            keep_T &= base.known_T.to(keep_T.device)
        if not keep_T.any():
            return
        now_TE, base_TE = logits_TE[keep_T], base_TE[keep_T].to(logits_TE.dtype)
        spec = frozen["spec"]
        ids_now_TK = select(now_TE, spec, None, expert_bias_of(layer, self.facts))
        ids_base_TK = select(base_TE, spec, None, frozen["expert_bias"])
        hits = (ids_now_TK.unsqueeze(-1) == ids_base_TK.unsqueeze(-2)).any(-1).sum()
        p_base = router_probs(base_TE.float(), self.transform).double()
        p_now = router_probs(now_TE.float(), self.transform).double()
        kl = (p_base * (p_base.clamp_min(1e-30).log() - p_now.clamp_min(1e-30).log())).sum()
        self.window.own_LF[pos] += torch.tensor([float(keep_T.sum()), float(hits) / spec.top_k, float(kl)])

    def _observe(self, pos: int, hidden, logits_TE) -> None:
        """One router call. Both selections, the router's now and the base's, are made here by the family's rule
        on logits of the live forward's precision (under bfloat16 autocast the router's logits are bfloat16, and
        the base's are rounded alike), so identical routers read overlap 1 and KL 0 in any precision (the router's own
        ids, which the anchor's tap hands over, may break a bfloat16 tie in other arithmetic: not reused)."""
        layer, base = self.layers[pos], self.base[pos]
        h_TH = hidden.reshape(-1, hidden.shape[-1])
        logits_TE = logits_TE.reshape(-1, logits_TE.shape[-1])
        if self._mask_source in ("attention", None) and not self._said_unlabelled:
            self._said_unlabelled = True  # label smoothing, compute_loss_func and TRL's RL trainers drop labels
            logger.warning(
                "rpb monitor: a forward without labels: its figures count %s, prompts included; "
                "RoutingMonitor.tokens(mask) narrows them (e.g. to completion tokens)",
                "every attended token" if self._mask_source else "every token",
            )
        if self._mask_source == "given" and self._mask_T.numel() != h_TH.shape[0]:
            raise ArgumentError(
                f"RoutingMonitor.tokens: the mask holds {self._mask_T.numel()} tokens, router "
                f"{layer.name} saw {h_TH.shape[0]}"
            )
        if self._mask_T is not None and self._mask_T.numel() == h_TH.shape[0]:
            keep = self._mask_T.to(h_TH.device)
            h_TH, logits_TE = h_TH[keep], logits_TE[keep]
        if h_TH.shape[0] == 0:
            return
        base_TE = functional.linear(
            h_TH.float(),
            base["weight"].float().to(h_TH.device),
            None if base["bias"] is None else base["bias"].float().to(h_TH.device),
        ).to(logits_TE.dtype)
        spec = base["spec"]
        ids_now_TK = select(logits_TE, spec, None, expert_bias_of(layer, self.facts))
        ids_base_TK = select(base_TE, spec, None, base["expert_bias"])
        hits = (ids_now_TK.unsqueeze(-1) == ids_base_TK.unsqueeze(-2)).any(-1).sum()
        p_base = router_probs(base_TE.float(), self.transform).double()
        p_now = router_probs(logits_TE.float(), self.transform).double()
        kl = (p_base * (p_base.clamp_min(1e-30).log() - p_now.clamp_min(1e-30).log())).sum()
        w = self.window
        w.tokens[pos] += h_TH.shape[0]
        w.overlap[pos] += float(hits) / spec.top_k
        w.kl[pos] += float(kl)
        w.counts_LE[pos] += torch.bincount(ids_now_TK.reshape(-1).cpu(), minlength=spec.num_experts).double()

    # ---- figures -------------------------------------------------------------------------------------
    def flush(self) -> dict[str, float]:
        """The window's figures (summed over ranks first), as ``routing/...`` keys; the window restarts."""
        w = self.window
        flat = torch.cat([w.tokens, w.overlap, w.kl, w.counts_LE.reshape(-1), w.own_LF.reshape(-1)])
        if torch.distributed.is_available() and torch.distributed.is_initialized():
            flat = flat.to("cuda" if torch.cuda.is_available() else "cpu")
            torch.distributed.all_reduce(flat)
            flat = flat.cpu()
        L, E = w.counts_LE.shape
        tokens, overlap, kl = flat[:L], flat[L : 2 * L], flat[2 * L : 3 * L]
        counts_LE, own_LF = flat[3 * L : 3 * L + L * E].view(L, E), flat[3 * L + L * E :].view(L, 3)
        self._reset()
        seen = tokens > 0
        if not seen.any():
            return {}
        per_layer = layer_figures(tokens[seen], overlap[seen], kl[seen], counts_LE[seen])
        if bool((own_LF[seen, 0] > 0).all()):  # every layer's routing against the base's own forward
            own = own_LF[seen]
            per_layer["base_forward_topk_overlap"] = own[:, 1] / own[:, 0]
            per_layer["base_forward_kl"] = (own[:, 2] / own[:, 0]).clamp(min=0.0)
        indices = [m.layer_index for m, s in zip(self.layers, seen.tolist(), strict=True) if s]
        self.last_layers = {name: dict(zip(indices, v.tolist(), strict=True)) for name, v in per_layer.items()}
        out = {}
        for name, values in per_layer.items():
            out[f"routing/mean/{name}"] = float(values.mean())
            out[f"routing/min/{name}"] = float(values.min())
            out[f"routing/max/{name}"] = float(values.max())
            if self.config.per_layer:
                out |= {f"routing/layer_{i}/{name}": float(v) for i, v in zip(indices, values.tolist(), strict=True)}
        return out

    def alarms(self, figures: dict[str, float]) -> list[str]:
        """The configured thresholds these figures (the last ``flush()``'s) cross, each as a sentence naming
        the decoder layer that crossed it furthest (and any other that crossed it)."""
        c, out = self.config, []
        if c.min_overlap is not None and figures.get("routing/min/topk_overlap", math.inf) < c.min_overlap:
            where, also = self._layers_past("topk_overlap", lambda v: v < c.min_overlap, worst=min)
            out.append(
                f"{where}'s top-k overlap with the base fell to {figures['routing/min/topk_overlap']:.3f} "
                f"(alarm below {c.min_overlap}{also})"
            )
        if (
            c.max_dead_fraction is not None
            and figures.get("routing/max/dead_fraction", -math.inf) > c.max_dead_fraction
        ):
            where, also = self._layers_past("dead_fraction", lambda v: v > c.max_dead_fraction, worst=max)
            out.append(
                f"{where} left {figures['routing/max/dead_fraction']:.3f} of its experts unused "
                f"(alarm above {c.max_dead_fraction}{also})"
            )
        kl = figures.get("routing/mean/kl")
        if (
            c.max_kl_jump is not None
            and kl is not None
            and self._last_kl is not None
            and kl - self._last_kl > c.max_kl_jump
        ):
            out.append(
                f"the KL from the base, mean over the MoE layers, jumped {kl - self._last_kl:.4f} in one window "
                f"(alarm above {c.max_kl_jump})"
            )
        if kl is not None:
            self._last_kl = kl
        return out

    def _layers_past(self, figure: str, crossed, worst) -> tuple[str, str]:
        """("layer i", "; layers j, k too"): the decoder layer whose ``figure`` is ``worst`` among those that
        ``crossed`` the alarm in the last flush, and the others."""
        values = self.last_layers.get(figure, {})
        past = [i for i, v in values.items() if crossed(v)]
        if not past:
            return "a layer", ""
        first = worst(past, key=values.__getitem__)
        others = [str(i) for i in past if i != first]
        also = f"; layer{'s' if len(others) > 1 else ''} {', '.join(others)} too" if others else ""
        return f"layer {first}", also


def _whole(t: torch.Tensor | None) -> torch.Tensor | None:
    """A detached copy of a parameter's whole value: under FSDP2 each rank holds a shard (a DTensor), gathered
    here (a collective: every rank builds its monitor at the same point, as the Trainer's callbacks do)."""
    if t is None:
        return None
    t = t.detach()
    gather = getattr(t, "full_tensor", None)
    return (gather() if callable(gather) else t).clone()


def layer_figures(tokens_L, overlap_L, kl_L, counts_LE) -> dict[str, torch.Tensor]:
    """Each figure per layer, from a window's sums (see the module doc)."""
    E = counts_LE.shape[1]
    total_L = counts_LE.sum(-1)
    shares_LE = counts_LE / total_L.unsqueeze(-1)
    mean_L = counts_LE.mean(-1)
    entropy_L = -(shares_LE * shares_LE.clamp_min(1e-300).log()).sum(-1) / math.log(E)
    return {
        "topk_overlap": overlap_L / tokens_L,
        "kl": (kl_L / tokens_L).clamp(min=0.0),  # a KL is never negative: below 0 is the sum's rounding
        "load_cv": counts_LE.std(-1, unbiased=False) / mean_L,
        "max_share": shares_LE.max(-1).values,
        "dead_fraction": (counts_LE == 0).double().mean(-1),
        "entropy": entropy_L,
    }
