"""``routing-kd`` in a Trainer: the routing overlap with the base each optimizer step (``anchor/overlap``,
``anchor/overlap_min``: ``rpb.anchors.overlap``), and with ``anchor.target`` the controller that sets the next step's
λ from it (``anchor/lambda``: ``rpb.anchors.target``).

The hook counts every micro-batch of the step; at the step's end the counts are summed over the ranks (so every
rank reads the same m and steps the same λ), then measured and reset. A logging window logs the mean of its steps'
m, the lowest of their worst layers, and λ as the next step will use it. The controller's state is saved in every
checkpoint (``rpb_target.json``) and restored on resume. ``HoldingTrainer`` wires it, and the routing monitor (on
by default where the base's routing is at hand), into a Trainer: ``AnchorTrainerMixin`` and rpb's GRPOTrainer.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
from transformers import TrainerCallback

from rpb.anchors.target import TargetController, TargetSettings
from rpb.monitor.callback import attach_default_monitor
from rpb.monitor.routing import MonitorConfig

#: the controller's state in a checkpoint
TARGET_FILE = "rpb_target.json"


def controller_of(anchor) -> TargetController | None:
    """The controller of ``anchor.config.target`` (λ₀: ``anchor.lambda`` where given), None without a target."""
    target = getattr(anchor.config, "target", None)
    if target is None:
        return None
    lam = anchor.config.lambda_
    return TargetController(TargetSettings(target=target, **({"lambda_0": lam} if lam is not None else {})))


class RoutingHold(TrainerCallback):
    """Measures each optimizer step's overlap and steps the controller (module doc)."""

    def __init__(self, anchor, controller: TargetController | None):
        self.anchor, self.controller = anchor, controller
        self.window: list[tuple[float, float]] = []
        if controller is not None:
            anchor.lambda_now = controller.lam

    def rebind(self, anchor) -> None:
        """Count on ``anchor`` from now on (the same anchor reinstalled on another model)."""
        self.anchor = anchor
        if self.controller is not None:
            anchor.lambda_now = self.controller.lam

    def on_step_end(self, args, state, control, lr_scheduler=None, **kwargs):
        counts = self.anchor.overlap
        flat = counts.flat()
        dist = torch.distributed
        if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
            flat = flat.cuda() if dist.get_backend() == "nccl" else flat
            dist.all_reduce(flat)
            counts.from_flat(flat.cpu())
        measured = counts.measure()
        counts.reset()
        if measured is None:
            return
        self.window.append(measured)
        if self.controller is not None:
            lr = lr_scheduler.get_last_lr()[0] if lr_scheduler is not None else None
            self.anchor.lambda_now = self.controller.update(measured[0], lr, args.learning_rate)

    def logs(self) -> dict[str, float]:
        """The window's figures (empty where no step measured), and the window restarts."""
        window, self.window = self.window, []
        out = {}
        if window:
            out["anchor/overlap"] = sum(m for m, _ in window) / len(window)
            out["anchor/overlap_min"] = min(low for _, low in window)
        if self.controller is not None:
            out["anchor/lambda"] = self.controller.lam
        return out

    def save(self, output_dir: str) -> None:
        if self.controller is not None:
            (Path(output_dir) / TARGET_FILE).write_text(json.dumps(self.controller.state_dict()))

    def load(self, checkpoint: str) -> None:
        if self.controller is None:
            return
        path = Path(checkpoint) / TARGET_FILE
        if not path.is_file():
            raise FileNotFoundError(
                f"{checkpoint}: no {TARGET_FILE}; a run with anchor.target resumes only from its own"
            )
        self.controller.load_state_dict(json.loads(path.read_text()))
        self.anchor.lambda_now = self.controller.lam


class HoldingTrainer:
    """A Trainer mixin (before the Trainer class): ``routing-kd``'s ``RoutingHold`` (``rpb_hold``: its overlap in the
    logs, a target's λ, the controller's state in every checkpoint) and the default monitor (``rpb_monitor``,
    ``attach_default_monitor``). The subclass calls ``hold_routing`` once ``self.anchor`` is set and the Trainer
    built, and adds ``hold_logs()`` to each training log."""

    rpb_hold: RoutingHold | None = None
    rpb_monitor = None

    def hold_routing(self, monitor: MonitorConfig | None = None) -> None:
        anchor = self.anchor
        self.rpb_hold = RoutingHold(anchor, controller_of(anchor)) if anchor.overlap is not None else None
        if self.rpb_hold is not None:
            self.add_callback(self.rpb_hold)
        # the routing's drift in the logs: on by default where the base's routing is at hand (MonitorConfig.enabled)
        self.rpb_monitor = attach_default_monitor(self, monitor)

    def rebind_anchor(self, anchor) -> None:
        """The anchor moved onto another model (``AnchorHandle.reinstall``, e.g. once TRL wrapped it with PEFT): the
        step's overlap, the controller's λ and the monitor's taps follow it."""
        self.anchor = anchor
        if self.rpb_hold is not None:
            self.rpb_hold.rebind(anchor)
        if self.rpb_monitor is not None:
            self.rpb_monitor.anchor = anchor

    def hold_logs(self) -> dict[str, float]:
        return self.rpb_hold.logs() if self.rpb_hold is not None else {}

    def _save_optimizer_and_scheduler(self, output_dir: str) -> None:
        super()._save_optimizer_and_scheduler(output_dir)
        if self.rpb_hold is not None and self.args.should_save:
            self.rpb_hold.save(output_dir)

    def _load_optimizer_and_scheduler(self, checkpoint: str | None) -> None:
        super()._load_optimizer_and_scheduler(checkpoint)
        if self.rpb_hold is not None and checkpoint is not None:
            self.rpb_hold.load(checkpoint)
