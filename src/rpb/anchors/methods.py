"""The anchoring methods as data: one entry per method says what it constrains and what it needs.

| `anchor.method` | what it does in training mode | needs |
|---|---|---|
| `sft` | plain fine-tuning, native router, no auxiliary loss |  |
| `lbl` | + `lbl_coef` × re-applied load-balancing loss, per layer, averaged | `lbl_coef` |
| `rpb` | top-k chosen on `z + beta * b[x, s, l]` (eq. 4); gates from the unbiased `z` | prior |
| `router-l2` | + `lambda` × mean over layers of ‖W − W_base‖² (eq. 5) | `lambda` |
| `kl-to-base` | + `lambda` × mean over tokens and layers of KL(p_base ‖ p) | `lambda` |
| `logit-l2` | + `lambda` × mean ‖(z − mean z) − (z_base − mean z_base)‖² | `lambda` |
| `rpb-hard` | top-k of the prior alone; gates as for `rpb` | prior |
| `within-soft` | `rpb` on the prior shuffled within base co-activation communities | prior |
| `within-hard` | `rpb-hard` on the prior shuffled within base co-activation communities | prior |
| `global-hard` | `rpb-hard` on the prior shuffled over all experts | prior |
| `router-freeze` | router weights frozen (today's strictest practice) |  |
| `within-transition-soft` | `rpb` on the prior shuffled within base transition communities (rpb's own) | prior |
| `within-transition-hard` | `rpb-hard` on the prior shuffled within base transition communities (rpb's own) | prior |
| `routing-kd` | + `lambda` × mean KL(q_base ‖ p) over tokens, layers; q_base: base's own forward | `lambda`, base |
| `output-kd` | + `lambda` × mean KL(base next-token distribution ‖ model's) over the loss's tokens | `lambda`, base |
| `routing-kd-router` | `routing-kd`, router input detached: gradient to the routers alone (control) | `lambda`, base |
| `hidden-kd` | + `lambda` × mean ‖h − h_base‖² / mean ‖h_base‖² at each MoE router's input (control) | `lambda`, base |

(``methods_table()`` renders this table from ``METHODS``; a test keeps it, and docs/methods.md's, in step.)

Everything else derives from the entries: which methods need a prior, the base router, the
base communities or a coefficient (``rpb train``'s checks, the Megatron path's refusals),
which weights the toy-world grids search, and which study tables list a method. Adding a
loss-based method is one ``Method`` entry here with a ``LossAnchor``, its math (a pure function,
as in ``rpb.losses``), and its tests; the HF hook and the Megatron router both dispatch to
``LossAnchor.term`` with a ``RouterState``.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Literal

import torch

from rpb import losses
from rpb.errors import ArgumentError
from rpb.routing import RouterSpec

#: what a loss term may read of a router in one step (``RouterState``'s fields)
LossInput = Literal["logits", "base_logits", "weights", "base_routing", "detached_logits", "hidden", "base_hidden"]


@dataclass
class RouterState:
    """One router in one step, as a loss term sees it; the fields the term does not read are None.

    ``logits_TE`` are the router's logits for the step's tokens and ``valid_T`` the tokens that
    count (not padding); ``base_logits_TE`` the frozen base router's logits on the same router
    input, float32; ``weights`` pairs each router parameter with its frozen float32 base copy.
    The base's own routing of the same tokens (``rpb.teacher``), on the base's own hidden states:
    ``routing_logits_TE`` (online: the base router's logits in the base's forward) or
    ``routing_ids_TK`` with ``routing_probs_TK`` (stored routes: its top-k, and its probabilities
    there or None). ``hidden_TH`` is the router's input in the model's forward (with its graph) and
    ``base_hidden_TH`` the base's at the same router in the base's own forward (``hidden-kd``).
    """

    score_function: str
    top_k: int
    #: the distribution KL-type terms compare: the prior's router transform (softmax without a prior)
    transform: str
    logits_TE: torch.Tensor | None = None
    valid_T: torch.Tensor | None = None
    base_logits_TE: torch.Tensor | None = None
    weights: tuple[tuple[torch.Tensor, torch.Tensor], ...] = ()
    routing_logits_TE: torch.Tensor | None = None
    routing_ids_TK: torch.Tensor | None = None
    routing_probs_TK: torch.Tensor | None = None
    #: stored routes of a ``--top-m`` file: the next experts by probability after the top-k, and their probabilities
    routing_extra_ids_TJ: torch.Tensor | None = None
    routing_extra_probs_TJ: torch.Tensor | None = None
    hidden_TH: torch.Tensor | None = None
    base_hidden_TH: torch.Tensor | None = None
    #: the router's selection rule and expert-correction bias (stored routes: the ids-alone hinge reads them)
    spec: RouterSpec | None = None
    expert_bias_E: torch.Tensor | None = None
    #: what a term reports back besides its value: the tokens where the ids-alone hinge is active (logged)
    active_T: torch.Tensor | None = None
    #: stored routes: the term's form (``ROUTES_LOSSES``; None: ``bucket`` with probabilities, ``hinge`` without)
    routes_loss: str | None = None


@dataclass(frozen=True)
class LossAnchor:
    """A loss-based anchor: one router's term for one step, and what the term reads."""

    term: Callable[[RouterState], torch.Tensor]
    reads: frozenset[LossInput]

    @property
    def from_forward(self) -> bool:
        """The term needs the step's forward (its logits), not the router's weights alone."""
        return bool(self.reads & {"logits", "base_logits", "base_routing", "detached_logits", "hidden"})

    @property
    def reads_base(self) -> bool:
        """The term reads what the base's own forward (or its stored routes) gives."""
        return bool(self.reads & {"base_routing", "base_hidden"})


@dataclass(frozen=True)
class Method:
    name: str
    #: one line for the methods table: what it does in training mode
    summary: str
    #: "soft" (bias on logits), "hard" (the prior forces the top-k) or None (native selection)
    selection: Literal["soft", "hard"] | None = None
    #: "within" (base co-activation communities), "within-transition" (base transition communities)
    #: or "global" shuffle of the prior, or None
    shuffle: Literal["within", "within-transition", "global"] | None = None
    loss: LossAnchor | None = None
    #: the AnchorConfig field holding the loss's coefficient (required, no default)
    coefficient: Literal["lambda_", "lbl_coef"] | None = None
    freeze_router: bool = False
    #: weights the toy-world grids try for ``coefficient``, chosen on the validation split
    weights: tuple[float, ...] = ()
    #: study tables that list the method besides the main one ("forms", "controls")
    tables: tuple[str, ...] = ()
    #: one of the paper's methods (the toy world's ``full`` grid), or a control this project adds
    in_paper: bool = True
    #: what the base model teaches (``rpb.teacher``): "routing" (its routing on its own hidden states, per token and
    #: layer) or "output" (its next-token distribution); None: no base forward or route file
    teacher: Literal["routing", "output"] | None = None

    @property
    def needs_prior(self) -> bool:
        return self.selection is not None

    @property
    def needs_base_router(self) -> bool:
        """A frozen copy of the base router (its weights) is kept for the loss term."""
        return self.loss is not None and bool(self.loss.reads & {"base_logits", "weights"})

    @property
    def needs_base_logits(self) -> bool:
        return self.loss is not None and "base_logits" in self.loss.reads

    @property
    def needs_communities(self) -> bool:
        """The base model's co-activation (or transition) communities, built from the training data."""
        return self.shuffle in ("within", "within-transition")

    @property
    def needs(self) -> list[str]:
        """What the configuration must supply, as the methods table says it."""
        out = [f"`{self.coefficient.rstrip('_')}`"] if self.coefficient else []
        return out + (["prior"] if self.needs_prior else []) + (["base"] if self.teacher else [])


def _lbl(s: RouterState) -> torch.Tensor:
    form = losses.load_balancing_sigmoid if s.score_function == "sigmoid" else losses.load_balancing_softmax
    return form(s.logits_TE, s.top_k, s.valid_T)


def _router_l2(s: RouterState) -> torch.Tensor:
    total = None
    for weight, base in s.weights:
        term = losses.router_l2(weight, base)
        total = term if total is None else total + term
    return total


LBL = LossAnchor(_lbl, frozenset({"logits"}))
ROUTER_L2 = LossAnchor(_router_l2, frozenset({"weights"}))
KL_TO_BASE = LossAnchor(
    lambda s: losses.kl_to_base(s.logits_TE, s.base_logits_TE, s.valid_T, s.transform),
    frozenset({"logits", "base_logits"}),
)


def _routing_kd(s: RouterState) -> torch.Tensor:
    if s.routing_ids_TK is not None:  # stored routes: the base's top-k (and its probabilities there)
        form = losses.routes_loss_form(s.routes_loss, s.routing_probs_TK is not None)
        if form in losses.ROUTES_LOSSES_WITH_PROBS and s.routing_probs_TK is None:
            raise ValueError(f"anchor.routes_loss={form} reads the base's probabilities; the route file has ids alone")
        if form == "hinge":
            term, s.active_T = losses.routing_kd_hinge(
                s.logits_TE, s.routing_ids_TK, s.valid_T, s.spec, s.expert_bias_E
            )
            return term
        if form == "bucket":
            ids_TM, probs_TM = s.routing_ids_TK, s.routing_probs_TK
            if s.routing_extra_ids_TJ is not None:  # the experts stored beyond the top-k refine the coarsening
                ids_TM = torch.cat([ids_TM, s.routing_extra_ids_TJ], -1)
                probs_TM = torch.cat([probs_TM, s.routing_extra_probs_TJ], -1)
            return losses.routing_kd_bucket(s.logits_TE, ids_TM, probs_TM, s.valid_T, s.transform)
        probs = s.routing_probs_TK if form == "topk-kl" else None
        return losses.routing_kd_topk(s.logits_TE, s.routing_ids_TK, probs, s.valid_T, s.transform)
    # online: KL(q || p) with q from the base's own forward, which is kl-to-base's formula on other base logits
    return losses.kl_to_base(s.logits_TE, s.routing_logits_TE, s.valid_T, s.transform)


ROUTING_KD = LossAnchor(_routing_kd, frozenset({"logits", "base_routing"}))


def take_stored(state: RouterState, base, pos: int, device, routes_loss: str | None) -> None:
    """Put MoE layer ``pos``'s rows of stored routes (``rpb.teacher.BaseRouting``: ids, probabilities, the
    ``--top-m`` file's extra experts) into ``state``, on ``device``."""
    state.routing_ids_TK = base.ids_LTK[pos].to(device)
    state.routing_probs_TK = None if base.probs_LTK is None else base.probs_LTK[pos].to(device)
    if base.extra_ids_LTJ is not None:
        state.routing_extra_ids_TJ = base.extra_ids_LTJ[pos].to(device)
        state.routing_extra_probs_TJ = base.extra_probs_LTJ[pos].to(device)
    state.routes_loss = routes_loss


#: the two controls of why routing-kd holds (docs/methods.md): the same KL with the router's input detached, so
#: that only the routers' weights take its gradient; and a hold on the routers' inputs themselves, no routing in it
ROUTING_KD_ROUTER = LossAnchor(_routing_kd, frozenset({"detached_logits", "base_routing"}))
HIDDEN_KD = LossAnchor(
    lambda s: losses.hidden_kd(s.hidden_TH, s.base_hidden_TH, s.valid_T), frozenset({"hidden", "base_hidden"})
)
LOGIT_L2 = LossAnchor(
    lambda s: losses.logit_l2(s.logits_TE, s.base_logits_TE, s.valid_T), frozenset({"logits", "base_logits"})
)

METHODS: dict[str, Method] = {}


def register_method(method: Method, *, overwrite: bool = False) -> Method:
    """Add (or, with overwrite=True, replace) a method of the table."""
    problems = []
    if method.name in METHODS and not overwrite:
        problems.append(f"method {method.name!r} exists; pass overwrite=True to replace it")
    if (method.loss is None and method.teacher != "output") != (method.coefficient is None):
        problems.append(f"method {method.name!r}: a loss and its coefficient go together (or the output teacher's)")
    if method.loss is not None and method.loss.reads_base and method.teacher != "routing":
        problems.append(f"method {method.name!r}: a loss reading the base's forward needs teacher='routing'")
    if method.weights and method.coefficient is None:
        problems.append(f"method {method.name!r}: weights to search need a coefficient")
    if method.shuffle is not None and method.selection is None:
        problems.append(f"method {method.name!r}: a shuffled prior needs a prior-based selection")
    if problems:
        raise ArgumentError("; ".join(problems))
    METHODS[method.name] = method
    return method


_SHUFFLED = "on the prior shuffled"
# the registry, kept as a table (fmt: skip below): one method per entry, its name, description and settings
# side by side; the formatter would spread each over a line per argument and bury the names
for _method in (
    Method("sft", "plain fine-tuning, native router, no auxiliary loss", tables=("forms",)),
    Method(
        "lbl", "+ `lbl_coef` × re-applied load-balancing loss, per layer, averaged", loss=LBL,
        coefficient="lbl_coef", weights=(0.001, 0.01, 0.1), tables=("forms",),
    ),
    Method(
        "rpb", "top-k chosen on `z + beta * b[x, s, l]` (eq. 4); gates from the unbiased `z`", selection="soft",
        tables=("forms", "controls"),
    ),
    Method(
        "router-l2", "+ `lambda` × mean over layers of ‖W − W_base‖² (eq. 5)", loss=ROUTER_L2,
        coefficient="lambda_", weights=(0.01, 0.1, 1.0), tables=("forms",),
    ),
    Method(
        "kl-to-base", "+ `lambda` × mean over tokens and layers of KL(p_base ‖ p)", loss=KL_TO_BASE,
        coefficient="lambda_", weights=(0.01, 0.1, 1.0), tables=("forms",),
    ),
    Method(
        "logit-l2", "+ `lambda` × mean ‖(z − mean z) − (z_base − mean z_base)‖²", loss=LOGIT_L2,
        coefficient="lambda_", weights=(0.001, 0.01, 0.1), tables=("forms",),
    ),
    Method("rpb-hard", "top-k of the prior alone; gates as for `rpb`", selection="hard"),
    Method(
        "within-soft", f"`rpb` {_SHUFFLED} within base co-activation communities", selection="soft",
        shuffle="within", tables=("controls",),
    ),
    Method(
        "within-hard", f"`rpb-hard` {_SHUFFLED} within base co-activation communities", selection="hard",
        shuffle="within", tables=("controls",),
    ),
    Method(
        "global-hard", f"`rpb-hard` {_SHUFFLED} over all experts", selection="hard", shuffle="global",
        tables=("controls",),
    ),
    Method("router-freeze", "router weights frozen (today's strictest practice)", freeze_router=True),
    Method(
        "within-transition-soft", f"`rpb` {_SHUFFLED} within base transition communities (rpb's own)",
        selection="soft", shuffle="within-transition", in_paper=False,
    ),
    Method(
        "within-transition-hard", f"`rpb-hard` {_SHUFFLED} within base transition communities (rpb's own)",
        selection="hard", shuffle="within-transition", in_paper=False,
    ),
    Method(
        "routing-kd", "+ `lambda` × mean KL(q_base ‖ p) over tokens, layers; q_base: base's own forward",
        loss=ROUTING_KD, coefficient="lambda_", weights=(0.01, 0.1, 1.0, 10.0), in_paper=False, teacher="routing",
    ),
    Method(
        "output-kd", "+ `lambda` × mean KL(base next-token distribution ‖ model's) over the loss's tokens",
        coefficient="lambda_", weights=(0.01, 0.1, 1.0), in_paper=False, teacher="output",
    ),
    Method(
        "routing-kd-router", "`routing-kd`, router input detached: gradient to the routers alone (control)",
        loss=ROUTING_KD_ROUTER, coefficient="lambda_", weights=(0.01, 0.1, 1.0, 10.0),
        in_paper=False, teacher="routing",
    ),
    Method(
        "hidden-kd", "+ `lambda` × mean ‖h − h_base‖² / mean ‖h_base‖² at each MoE router's input (control)",
        loss=HIDDEN_KD, coefficient="lambda_", weights=(0.01, 0.1, 1.0, 10.0), in_paper=False,
        teacher="routing",
    ),
):  # fmt: skip
    register_method(_method)


def get_method(name: str) -> Method:
    try:
        return METHODS[name]
    except KeyError:
        raise ArgumentError(f"unknown anchor method {name!r}; choose one of {', '.join(METHODS)}") from None


def methods_table() -> str:
    """The methods table in Markdown, as this module's docstring and docs/methods.md show it."""
    lines = ["| `anchor.method` | what it does in training mode | needs |", "|---|---|---|"]
    lines += [f"| `{m.name}` | {m.summary} | {', '.join(m.needs)} |" for m in METHODS.values()]
    return "\n".join(lines)
