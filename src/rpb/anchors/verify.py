"""Checking a prior against the run about to use it: one error naming every mismatched field."""

from __future__ import annotations

from dataclasses import dataclass, field

from rpb.errors import RpbError
from rpb.prior.artifact import ROUTED_ALL_POSITIONS


class PriorMismatchError(RpbError):
    def __init__(self, path: str, mismatches: list[tuple[str, object, object]]):
        self.mismatches = mismatches
        lines = [
            f"  {name}: the prior has {expected!r}, this run has {found!r}" for name, expected, found in mismatches
        ]
        super().__init__(
            f"the prior {path} does not belong to this run ({len(mismatches)} mismatched field(s)):\n"
            + "\n".join(lines)
            + "\nrecollect it with `rpb collect` on this model and data file"
        )


@dataclass(frozen=True)
class RunFacts:
    """What the training run sees, in the prior metadata's terms."""

    data_sha256: str
    num_rows: int
    model: str
    routers_sha256: str
    tokenizer: str
    chat_template_sha256: str
    top_k: int
    max_seq_len: int
    moe_layers: list
    num_experts: int
    #: the run's explicit transform (None: the prior's); not a mismatch when it differs, only said
    #: (``rpb.anchors.transform.run_transform``): the prior's routing does not depend on it
    router_transform: str | None = None
    routed_positions: str = ROUTED_ALL_POSITIONS
    #: the chat template's keyword arguments (enable_thinking, ...): another value renders other tokens
    chat_template_kwargs: dict = field(default_factory=dict)


def model_mismatches(
    meta: dict, *, model: str, routers_sha256: str, top_k: int, moe_layers: list, num_experts: int
) -> list[tuple[str, object, object]]:
    """The fields where the prior's model is not ``model``: its routers' fingerprint (reported with
    the model ids), top-k, MoE layers, experts. ``rpb train`` and ``rpb validate`` both judge by it."""
    out: list[tuple[str, object, object]] = []
    if meta.get("routers_sha256") != routers_sha256:
        out += [("model", meta.get("model"), model), ("routers_sha256", meta.get("routers_sha256"), routers_sha256)]
    for name, found in (("top_k", top_k), ("moe_layers", list(moe_layers)), ("num_experts", num_experts)):
        if meta.get(name) != found:
            out.append((name, meta.get(name), found))
    return out


def verify_prior(meta: dict, run: RunFacts, path: str = "prior") -> None:
    """Raise PriorMismatchError naming every field where ``meta`` and ``run`` disagree.

    Model and tokenizer identity are their routers' fingerprint and their chat template's
    hash: a checkpoint or tokenizer that moved to another path is the same, one with the
    same config but other weights is not. Their ids are reported alongside.
    """
    mismatches: list[tuple[str, object, object]] = []

    def check(name: str, expected, found):
        if expected != found:
            mismatches.append((name, expected, found))

    check("data_sha256", meta.get("data_sha256"), run.data_sha256)
    check("num_rows", meta.get("num_rows"), run.num_rows)
    model = model_mismatches(
        meta,
        model=run.model,
        routers_sha256=run.routers_sha256,
        top_k=run.top_k,
        moe_layers=run.moe_layers,
        num_experts=run.num_experts,
    )
    mismatches += [m for m in model if m[0] in ("model", "routers_sha256")]
    if meta.get("chat_template_sha256") != run.chat_template_sha256:
        mismatches.append(("tokenizer", meta.get("tokenizer"), run.tokenizer))
        check("chat_template_sha256", meta.get("chat_template_sha256"), run.chat_template_sha256)
    # a prior of schema 1 was rendered without keyword arguments (rpb had none to give)
    check("chat_template_kwargs", meta.get("chat_template_kwargs", {}), run.chat_template_kwargs)
    mismatches += [m for m in model if m[0] == "top_k"]
    check("max_seq_len", meta.get("max_seq_len"), run.max_seq_len)
    check("routed_positions", meta.get("routed_positions"), run.routed_positions)
    mismatches += [m for m in model if m[0] in ("moe_layers", "num_experts")]
    if mismatches:
        raise PriorMismatchError(path, mismatches)
