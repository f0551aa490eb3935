"""The beta rule: a beta read off the base, the prior and the data alone, before any training.

Fixed before it was tested. It was written, and this file committed, before the toy world's bases 1
and 2 were pretrained; its figures on base 0 were known (in-sample), those on bases 1 and 2 were not.
``calibrate.json`` records ``RULE_SHA256``, the sha256 of this file, so any later change to the
rule shows.

The rule. The prior is a span mean: where the base sends the tokens of one span to different
experts, a bias strong enough to matter pushes each token toward the span's average experts, away
from the base's own token-level choice. A bias *holds* the base while it leaves most content tokens
where the base put them, and *replaces* it once it moves most of them. So: among the candidate
betas, in increasing order, take the largest one before the first whose counterfactual
displacement -- the fraction of content (Q / A) tokens whose selected expert set the bias changes,
applied to the base's own logits one layer at a time, averaged over MoE layers -- exceeds one half.
Beta 0 (no bias: ``sft``) when even the smallest candidate moves more than half of them.
"""

from __future__ import annotations

import hashlib
from pathlib import Path

#: the largest acceptable mean counterfactual displacement over content tokens: "moves fewer than half"
DISPLACEMENT_LIMIT = 0.5
#: the statistic the rule reads, as calibrate.json names it
STATISTIC = "displacement_counterfactual (content tokens, mean over MoE layers)"
RULE_SHA256 = hashlib.sha256(Path(__file__).read_bytes()).hexdigest()


def recommend_beta(displacement_by_beta: dict[float, float], limit: float = DISPLACEMENT_LIMIT) -> float:
    """The rule: the largest candidate beta, in increasing order, before the first whose mean
    displacement exceeds ``limit``; 0.0 when the smallest already does. Beta 0 itself, if among the
    candidates, always qualifies (it moves nothing)."""
    chosen = 0.0
    for beta in sorted(displacement_by_beta):
        if displacement_by_beta[beta] > limit:
            break
        chosen = beta
    return chosen


def describe() -> dict:
    """The rule as calibrate.json records it."""
    return {"limit": DISPLACEMENT_LIMIT, "statistic": STATISTIC, "source_sha256": RULE_SHA256,
            "source": "rpb/calibrate/rule.py"}  # fmt: skip
