"""A routing target instead of a fixed λ: ``routing-kd``'s coefficient steered so that the step's routing overlap with
the base stays at or above a target (``anchor.target``), as the adaptive KL controllers of RL steer β to a KL target.

The measure ``m`` (``anchor/overlap``) is the optimizer step's mean over MoE layers of each layer's token mean of
``|S ∩ S_base| / k``: S the model's top-k set under the family's own selection, S_base the base's (its own forward,
or stored routes), counted over every micro-batch of the step and every rank. The constraint is ``m >= target``,
λ its multiplier, updated once per optimizer step by one rule (pure: floats in, floats out):

    e  = clip((target - m) / (1 - target), -clip, +clip)      # > 0: below the target; 1 - target is the drift allowed
    λ <- clamp(λ * exp(rate * e), lambda_min, lambda_max)

multiplicative in log space, the error normalised by the drift the target allows (so one rate serves a target of
0.7 and of 0.95) and clipped, as Ziegler et al.'s controller clips its proportional error. Guards:

* **start**: at step 0 the model is the base (m = 1), and a controller that lowered λ while the routing has not yet
  moved would arrive at the first drift with λ at its floor. λ stays λ₀ until m first falls below the target.
* **anti-windup**: while the learning rate is below ``quiet_lr_share`` (5%) of its peak (warm-up, a cosine tail) λ
  is not raised: the routing cannot be brought back by a step that barely moves the model, and λ would wind up.
* **unreachable**: λ held at ``lambda_max`` with m below the target for ``patience_steps`` steps in a row warns
  once, naming the target (the model's drift is beyond what the term can hold at λ_max).

``TargetController.state_dict`` / ``load_state_dict`` carry the whole state through checkpoints.
"""

from __future__ import annotations

import logging
import math
from dataclasses import asdict, dataclass, field

logger = logging.getLogger("rpb.anchors.target")


@dataclass
class TargetSettings:
    """``anchor.target`` and its controller's constants (defaulted: a user writes only the target)."""

    #: the routing overlap with the base to hold, in (0, 1]
    target: float
    #: λ until the routing first falls below the target
    lambda_0: float = 1.0
    lambda_min: float = 1e-3
    lambda_max: float = 1e3
    #: log-λ change per step at an error of 1 (the overlap one allowed drift below the target)
    rate: float = 0.1
    #: the error's bound, either side
    clip: float = 1.0
    #: λ is not raised while the learning rate is below this share of its peak
    quiet_lr_share: float = 0.05
    #: steps at λ_max, below the target, before the one warning
    patience_steps: int = 20

    def problems(self) -> list[str]:
        out = []
        if not 0 < self.target <= 1:
            out.append(f"anchor.target: the overlap to hold, in (0, 1], got {self.target}")
        if not 0 < self.lambda_min <= self.lambda_0 <= self.lambda_max:
            out.append(
                f"anchor.target: need 0 < lambda_min <= lambda_0 <= lambda_max, got {self.lambda_min}, "
                f"{self.lambda_0}, {self.lambda_max}"
            )
        if self.rate <= 0 or self.clip <= 0:
            out.append(f"anchor.target: rate and clip must be > 0, got {self.rate}, {self.clip}")
        return out


@dataclass
class TargetController:
    """λ steered to hold ``m >= target`` (module doc). ``update`` once per optimizer step."""

    settings: TargetSettings
    lam: float = field(default=math.nan)
    #: m has fallen below the target at least once (the start guard is off)
    armed: bool = False
    #: consecutive steps at λ_max with m below the target
    at_max: int = 0
    warned: bool = False
    steps: int = 0

    def __post_init__(self):
        if math.isnan(self.lam):
            self.lam = self.settings.lambda_0

    def error(self, m: float) -> float:
        s = self.settings
        allowed = max(1.0 - s.target, 1e-6)  # a target of 1 allows no drift: any shortfall is a full error
        return min(max((s.target - m) / allowed, -s.clip), s.clip)

    def update(self, m: float, lr: float | None = None, peak_lr: float | None = None) -> float:
        """λ for the next step, from this step's measure ``m`` and learning rate (None: never quiet)."""
        s = self.settings
        self.steps += 1
        if not self.armed and m < s.target:
            self.armed = True
        if self.armed:
            e = self.error(m)
            quiet = lr is not None and peak_lr and lr < s.quiet_lr_share * peak_lr
            if not (quiet and e > 0):
                self.lam = min(max(self.lam * math.exp(s.rate * e), s.lambda_min), s.lambda_max)
        stuck = self.lam >= s.lambda_max and m < s.target
        self.at_max = self.at_max + 1 if stuck else 0
        if self.at_max >= s.patience_steps and not self.warned:
            self.warned = True
            logger.warning(
                "rpb: anchor.target=%g looks unreachable: the routing overlap stayed below it (%.4f) with lambda at "
                "its maximum (%g) for %d steps; lower the target, or the learning rate",
                s.target,
                m,
                s.lambda_max,
                self.at_max,
            )
        return self.lam

    def state_dict(self) -> dict:
        state = {"lambda": self.lam, "armed": self.armed, "at_max": self.at_max, "warned": self.warned}
        return state | {"steps": self.steps, "settings": asdict(self.settings)}

    def load_state_dict(self, state: dict) -> None:
        if state.get("settings") != asdict(self.settings):
            raise ValueError(
                f"the checkpoint's target controller ran with {state.get('settings')}, this run's is "
                f"{asdict(self.settings)}"
            )
        self.lam, self.armed, self.at_max = float(state["lambda"]), bool(state["armed"]), int(state["at_max"])
        self.warned, self.steps = bool(state["warned"]), int(state["steps"])
