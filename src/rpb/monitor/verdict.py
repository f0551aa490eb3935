"""What an audit found, set against what the set-up asks (``rpb audit``; the run is ``rpb.monitor.audit``)."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Literal

from rpb.anchors import get_method

#: a gradient or change below this, relative to its reference size, is read as none (rounding of reruns)
RELATIVE_TOL = 1e-6
#: said to a set-up whose routers are all frozen with no anchor that holds the routing (the audit's note, the
#: monitor's first line): the question users ask most, answered from the toy world's ``full`` grid
FROZEN_ROUTERS_NOTE = (
    "the routers are frozen and no anchor holds the routing: a frozen router does not keep the routing, which "
    "drifts with the hidden states below it (the toy world's full grid: router-freeze kept a top-k overlap with the "
    "base of 0.565 / 0.642 against sft's 0.549 / 0.625, and -0.1 / +0.2 out-of-domain points); anchor.method="
    "routing-kd holds it (docs/methods.md)"
)


def frozen_without_hold(frozen: bool, anchor: str | None) -> bool:
    """Every router frozen, and no anchor that holds the routing itself (``routing-kd``)."""
    return frozen and (anchor is None or get_method(anchor).teacher != "routing")


@dataclass
class Asked:
    """What the set-up means to do to the routers."""

    #: "frozen": no router may change (weights, bias, expert-correction bias); "free": the routers train
    router: Literal["frozen", "free"] = "free"
    #: the rpb anchoring method meant to act (None: none)
    anchor: str | None = None
    #: whether the model's own load-balancing loss belongs in the loss (None: either; reported only)
    native_aux: bool | None = None
    #: with ``router="free"``: the MoE layers (decoder-layer indices) whose router alone is meant frozen
    frozen_layers: tuple[int, ...] = ()

    def frozen_at(self, layer: int) -> bool:
        """Whether the router of this MoE layer is meant frozen."""
        return self.router == "frozen" or layer in self.frozen_layers

    def describe(self, layer: int | None = None) -> str:
        router = self.router if layer is None else ("frozen" if self.frozen_at(layer) else "free")
        return router + (f", {self.anchor}" if self.anchor else "")


@dataclass
class LayerAudit:
    layer: int
    grad: float
    moved: float
    expert_bias: float | None
    anchor_grad: float | None
    aux_grad: float
    peft: str | None
    biased: float | None
    seen_by_anchor: bool | None


@dataclass
class AuditReport:
    asked: Asked
    layers: list[LayerAudit]
    #: the step-2 loss split: "lm", "anchor", "native_aux"
    loss: dict[str, float]
    #: whether the anchor's term moved any trainable parameter's gradient (None: no loss anchor)
    anchor_reaches: bool | None
    contradictions: list[str] = field(default_factory=list)
    #: what the set-up does not contradict but should know (``FROZEN_ROUTERS_NOTE``)
    notes: list[str] = field(default_factory=list)

    def table(self) -> str:
        f = lambda v: "-" if v is None else f"{v:.3g}"  # noqa: E731
        lines = [
            "| layer | asked | PEFT | grad | moved | expert bias | anchor grad | native aux grad | biased |",
            "|---|---|---|---|---|---|---|---|---|",
        ]
        for a in self.layers:
            lines.append(
                f"| {a.layer} | {self.asked.describe(a.layer)} | {a.peft or '-'} | {f(a.grad)} | "
                f"{f(a.moved)} | {f(a.expert_bias)} | {f(a.anchor_grad)} | {f(a.aux_grad)} | "
                f"{f(a.biased)} |"
            )
        s = self.loss
        lines.append(
            f"\nstep-2 loss: LM {s['lm']:.5g}, anchor term {s['anchor']:+.3g}, "
            f"native load-balancing loss {s['native_aux']:+.3g}"
        )
        if self.contradictions:
            lines += ["", "contradictions:", *(f"- {c}" for c in self.contradictions)]
        else:
            lines.append("no contradiction: the set-up does to the routers what was asked")
        lines += [f"note: {n}" for n in self.notes]
        return "\n".join(lines)

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)


def significant(difference: float, reference: float) -> bool:
    return abs(difference) > RELATIVE_TOL * max(abs(reference), 1e-30)


def _where(rows: list[LayerAudit]):
    """``where(pred)``: the layers among ``rows`` where ``pred`` holds, as a sentence names them ("" if none)."""

    def where(pred) -> str:
        hit = [str(a.layer) for a in rows if pred(a)]
        return f"MoE layer{'s' if len(hit) > 1 else ''} {', '.join(hit)}" if hit else ""

    return where


def contradictions(
    report: AuditReport, anchor_installed: bool, lm_grads: list[float], anchor_reach: list[bool] | None = None
) -> list[str]:
    """Every way what happened disagrees with what was asked, one sentence each (layers grouped);
    ``lm_grads``: each router's gradient norm from the LM loss alone, the scale its terms are read against;
    ``anchor_reach``: per layer, whether the anchor's term moved its router's gradient (read with the coefficient
    scaled up, ``rpb.monitor.audit``; None: from ``anchor_grad`` at the run's own coefficient)."""
    asked, rows, out = report.asked, report.layers, []
    frozen = [a for a in rows if asked.frozen_at(a.layer)]
    where = _where(frozen)  # first the layers whose router is meant frozen
    if w := where(lambda a: a.moved > 0):
        out.append(
            f"router frozen asked, router changed ({w}: its effective logits moved up to "
            f"{max(a.moved for a in frozen):.3g})"
        )
    if w := where(lambda a: a.expert_bias):
        out.append(
            f"router frozen asked, its expert-correction bias changed ({w}): something updates it "
            "outside the optimizer's gradients (a hook or a callback)"
        )
    if w := where(lambda a: a.peft):
        kinds = sorted({a.peft for a in frozen if a.peft})
        out.append(f"router frozen asked, but PEFT wraps the router ({w}: {', '.join(kinds)})")
    where = _where(rows)
    if w := where(lambda a: not asked.frozen_at(a.layer) and a.grad == 0 and a.moved == 0):
        out.append(f"router training asked, but no gradient reached the router ({w})")
    if asked.anchor is not None:
        method = get_method(asked.anchor)
        if not anchor_installed:
            out.append(f"anchor {asked.anchor} asked, but no rpb anchor is installed in this trainer")
        elif w := where(lambda a: a.seen_by_anchor is False):
            out.append(
                f"anchor {asked.anchor} asked, but its hooks saw no token ({w}): the step context is not "
                "set (a trainer without rpb's AnchorTrainerMixin) or they sit on a module the forward does "
                "not run (installed before PEFT wrapped the router?)"
            )
        if method.loss is not None and anchor_installed:
            reach = anchor_reach or [significant(a.anchor_grad or 0.0, g) for a, g in zip(rows, lm_grads, strict=True)]
            free = [r for a, r in zip(rows, reach, strict=True) if not asked.frozen_at(a.layer)]
            no_router_grad = method.loss.from_forward and bool(free) and not any(free)
            if method.name == "lbl" and (report.anchor_reaches is False or no_router_grad):
                out.append(
                    "lbl asked, but no load-balancing gradient reached the router (its term is never added "
                    "to the loss, or is detached)"
                )
            elif report.anchor_reaches is False:
                out.append(
                    f"{method.name} asked, but its loss term reached no trainable parameter's gradient "
                    "(never added to the loss, or detached)"
                )
    aux_in = significant(report.loss["native_aux"], report.loss["lm"]) or any(
        significant(a.aux_grad, g) for a, g in zip(rows, lm_grads, strict=True)
    )
    if asked.native_aux is False and aux_in:
        out.append(
            f"no native load-balancing loss asked, but the model's own is in the loss "
            f"({report.loss['native_aux']:+.3g} beside an LM loss of {report.loss['lm']:.4g}): set "
            "output_router_logits false or router_aux_loss_coef 0"
        )
    if asked.native_aux is True and not aux_in:
        out.append(
            "a native load-balancing loss asked, but none is in the loss (output_router_logits off, or "
            "its coefficient 0)"
        )
    return out
