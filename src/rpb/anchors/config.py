"""``anchor.*``: the anchor of a run, as ``rpb train`` and the Megatron path read it."""

from __future__ import annotations

from dataclasses import dataclass

from rpb.anchors.methods import METHODS, get_method
from rpb.errors import ArgumentError
from rpb.losses import ROUTES_LOSSES
from rpb.prior import DEFAULT_CLIP, DEFAULT_EPS, ROUTER_TRANSFORMS, RouterTransform

#: ``anchor.base``: where routing-kd and output-kd read the base from
BASE_SOURCES = ("online", "routes")


@dataclass
class AnchorConfig:
    """The anchoring method and its settings (YAML section ``anchor``).

    ``lambda_`` (YAML ``lambda``) and ``lbl_coef`` have no defaults: the methods that use them
    require them (the methods table says which).
    """

    #: a method of ``rpb.anchors.METHODS``
    method: str = "rpb"
    #: strength of the prior bias added to the router logits for selection (eq. 4)
    beta: float = 1.0
    #: floor of the clipped prior, as a fraction of uniform: q >= eps / E (eq. 3)
    eps: float = DEFAULT_EPS
    #: ceiling of the clipped prior, as a multiple of uniform: q <= C / E (eq. 3)
    c: float = DEFAULT_CLIP
    #: coefficient of router-l2, kl-to-base and logit-l2
    lambda_: float | None = None
    #: coefficient of lbl's re-applied load-balancing loss
    lbl_coef: float | None = None
    #: seed of the shuffled controls' permutations (and of their Louvain communities)
    shuffle_seed: int = 0
    #: kl-to-base's distribution; None: the prior's recorded transform (softmax without a prior)
    router_transform: RouterTransform | None = None
    #: Louvain resolution for the base communities of the within-* controls
    community_resolution: float = 1.0
    #: routing-kd / output-kd: where the base's routing comes from (``rpb.teacher``): "online", a no-grad forward
    #: of the base on each batch (LoRA: the adapters disabled; full fine-tuning: a frozen copy), or "routes", a
    #: route file of the base for exactly the training file (routing-kd only; no second model)
    base: str = "online"
    #: anchor.base=routes: the route file (``rpb routes [--with-probs]``, or an engine's routes; docs/collect.md)
    routes: str | None = None
    #: anchor.base=online under full fine-tuning: the frozen copy's dtype (None: the training dtype)
    base_dtype: str | None = None
    #: routing-kd / output-kd: ``model`` is a folder ``rpb train`` saved and its own routing is the one to hold
    #: (continued training); without it such a folder is refused as the base (``rpb.teacher.lineage``)
    trained_base: bool = False
    #: routing-kd: the routing overlap with the base to hold, in (0, 1]; λ is then steered each optimizer step to
    #: keep it (``rpb.anchors.target``; ``lambda``, where given, is where λ starts). None: the fixed ``lambda``
    target: float | None = None
    #: anchor.base=routes: routing-kd's stored-routes form (``rpb.anchors.methods.ROUTES_LOSSES``): None, ``bucket``
    #: where the file has the base's probabilities and ``hinge`` where it has ids alone (both 0 at the base)
    routes_loss: str | None = None

    @classmethod
    def for_method(cls, method: str, *, lambda_: float | None = None, lbl_coef: float | None = None, **settings):
        """The configuration of ``method`` with whichever of ``lambda_`` / ``lbl_coef`` it reads (a sweep over
        methods gives both; a coefficient the method does not read is refused by ``problems``)."""
        read = get_method(method).coefficient
        given = {"lambda_": lambda_, "lbl_coef": lbl_coef}
        return cls(method=method, **({read: given[read]} if read is not None else {}), **settings)

    def problems(self) -> list[str]:
        """Every problem with this configuration (empty when valid)."""
        try:
            method = get_method(self.method)
        except ArgumentError as e:
            return [f"anchor.method: {e}"]
        out = []
        steered = self.target is not None and method.teacher == "routing"
        if method.coefficient is not None and getattr(self, method.coefficient) is None and not steered:
            out.append(f"anchor.{method.coefficient.rstrip('_')}: required by method {self.method!r} (no default)")
        if self.target is not None and method.teacher != "routing":
            out.append(
                f"anchor.target: held by routing-kd, the method that measures the routing; not by {self.method!r}"
            )
        elif self.target is not None and not 0 < self.target <= 1:
            out.append(f"anchor.target: the overlap with the base to hold, in (0, 1], got {self.target}")
        for name in ("lambda_", "lbl_coef"):  # a coefficient the method never reads: a run that is not the one meant
            if name != method.coefficient and getattr(self, name) is not None:
                readers = ", ".join(m.name for m in METHODS.values() if m.coefficient == name)
                out.append(f"anchor.{name.rstrip('_')}: read only by {readers}, not by {self.method!r}")
        if self.routes_loss is not None and self.routes_loss not in ROUTES_LOSSES:
            out.append(f"anchor.routes_loss: one of {', '.join(ROUTES_LOSSES)}, got {self.routes_loss!r}")
        elif self.routes_loss is not None and not (method.teacher == "routing" and self.base == "routes"):
            out.append("anchor.routes_loss: the form of routing-kd's term from stored routes (anchor.base=routes)")
        if not 0 < self.eps <= 1:
            out.append(f"anchor.eps: must be in (0, 1], got {self.eps}")
        if self.c < 1:
            out.append(f"anchor.c: must be >= 1, got {self.c}")
        if self.beta < 0:
            out.append(f"anchor.beta: must be >= 0, got {self.beta}")
        if self.router_transform is not None and self.router_transform not in ROUTER_TRANSFORMS:
            out.append(f"anchor.router_transform: one of {ROUTER_TRANSFORMS}, got {self.router_transform!r}")
        return out + self._base_problems(method.teacher)

    def _base_problems(self, teacher: str | None) -> list[str]:
        if self.base not in BASE_SOURCES:
            return [f"anchor.base: one of {BASE_SOURCES}, got {self.base!r}"]
        out = []
        if teacher is None:
            unused = [f for f in ("routes", "base_dtype") if getattr(self, f) is not None]
            unused += ["trained_base"] if self.trained_base else []
            readers = ", ".join(m.name for m in METHODS.values() if m.teacher)
            out += [
                f"anchor.{f}: read only by the methods with a base ({readers}), not by {self.method!r}" for f in unused
            ]
            return out
        if self.base == "routes":
            if self.method == "hidden-kd":
                out.append(
                    "anchor.base=routes: hidden-kd holds the routers' inputs to the base's, which a route file does "
                    "not hold; use anchor.base=online"
                )
            if teacher == "output":
                out.append(
                    "anchor.base=routes: output-kd needs the base's next-token distribution, which a route file does "
                    "not hold; use anchor.base=online"
                )
            if self.routes is None:
                out.append("anchor.routes: required by anchor.base=routes (the base's route file: `rpb routes`)")
            if self.base_dtype is not None:
                out.append("anchor.base_dtype: the frozen copy's dtype, read only with anchor.base=online")
        elif self.routes is not None:
            out.append("anchor.routes: read only with anchor.base=routes (this run's base is online)")
        return out

    def coefficient(self) -> float | None:
        """The loss coefficient of the configured method (None for methods without a loss)."""
        field = get_method(self.method).coefficient
        return None if field is None else getattr(self, field)
