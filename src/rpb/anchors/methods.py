"""The anchoring methods as data: what each one constrains and what it needs.

| method        | training-time effect                                                    |
|---------------|-------------------------------------------------------------------------|
| sft           | plain fine-tuning, native router, no auxiliary loss                     |
| lbl           | + lbl_coef * re-applied load-balancing loss                             |
| rpb           | top-k chosen on z + beta * b[x, s, l] (eq. 4); gates from unbiased z    |
| router-l2     | + lambda * mean_l ||W_l - W_l^base||^2 (eq. 5)                           |
| kl-to-base    | + lambda * mean KL(p_base || p)                                         |
| logit-l2      | + lambda * mean ||centred z - centred z_base||^2                        |
| rpb-hard      | top-k of the prior pi[x, s, l] alone; gates from unbiased z             |
| within-soft   | rpb on the prior shuffled within base co-activation communities         |
| within-hard   | rpb-hard on that shuffled prior                                         |
| global-hard   | rpb-hard on the prior shuffled over all experts                         |
| router-freeze | router weights frozen (today's strictest practice)                      |
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Method:
    name: str
    #: "soft" (bias on logits), "hard" (prior forces top-k) or None (native selection)
    selection: str | None = None
    #: "within" or "global" shuffle of the prior, or None
    shuffle: str | None = None
    #: auxiliary loss: "lbl", "router-l2", "kl-to-base", "logit-l2" or None
    loss: str | None = None
    #: the config coefficient the loss needs ("lambda" or "lbl_coef"), required, no default
    coefficient: str | None = None
    freeze_router: bool = False

    @property
    def needs_prior(self) -> bool:
        return self.selection is not None

    @property
    def needs_base_router(self) -> bool:
        return self.loss in ("router-l2", "kl-to-base", "logit-l2")


METHODS: dict[str, Method] = {
    m.name: m
    for m in (
        Method("sft"),
        Method("lbl", loss="lbl", coefficient="lbl_coef"),
        Method("rpb", selection="soft"),
        Method("router-l2", loss="router-l2", coefficient="lambda"),
        Method("kl-to-base", loss="kl-to-base", coefficient="lambda"),
        Method("logit-l2", loss="logit-l2", coefficient="lambda"),
        Method("rpb-hard", selection="hard"),
        Method("within-soft", selection="soft", shuffle="within"),
        Method("within-hard", selection="hard", shuffle="within"),
        Method("global-hard", selection="hard", shuffle="global"),
        Method("router-freeze", freeze_router=True),
    )
}


def get_method(name: str) -> Method:
    try:
        return METHODS[name]
    except KeyError:
        raise ValueError(f"unknown anchor method {name!r}; choose one of {', '.join(METHODS)}") from None
