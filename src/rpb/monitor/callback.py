"""The routing monitor as a ``transformers.TrainerCallback`` (HF Trainer, TRL and what is built on them).

Callbacks a user adds run after the Trainer's own, whose logging callbacks (TensorBoard, W&B, ...) have then
already written the step's logs; ``attach_monitor`` puts this one first, so the figures it adds to the
``logs`` mapping reach every ``report_to`` integration. ``Trainer.log`` has already copied the logs into
``state.log_history`` (``trainer_state.json``) by then: the figures go into that step's entry too.
"""

from __future__ import annotations

import logging

from transformers import TrainerCallback

from rpb.monitor.routing import MonitorConfig, RoutingMonitor
from rpb.monitor.verdict import FROZEN_ROUTERS_NOTE, frozen_without_hold

logger = logging.getLogger("rpb.monitor")


class RoutingMonitorCallback(TrainerCallback):
    """``anchor``: the trainer's installed rpb anchor, whose taps the monitor then reads (``attach_monitor``
    passes it). Training-mode forwards only: an evaluation inside a logging window is not counted."""

    def __init__(self, config: MonitorConfig | None = None, adapter: str | None = None, anchor=None):
        self.config = config or MonitorConfig()
        self.adapter = adapter
        self.anchor = anchor
        self.monitor: RoutingMonitor | None = None

    def on_train_begin(self, args, state, control, model=None, **kwargs):
        if self.monitor is None:  # the base's routers: frozen before the first step changes them
            self.monitor = RoutingMonitor(model, self.config, self.adapter, self.anchor, training_only=True)
            frozen = all(not p.requires_grad for m in self.monitor.layers for p in m.router.parameters())
            if frozen_without_hold(frozen, self.anchor.method.name if self.anchor is not None else None):
                logger.warning("rpb monitor: %s", FROZEN_ROUTERS_NOTE)
        else:  # a later train() on the same trainer: the base kept, the last run's unlogged tail dropped
            self.monitor.flush()
        self.monitor.attach()  # (again: the last run's end removed the hooks)

    def on_step_begin(self, args, state, control, **kwargs):
        if self.monitor is not None:
            self.monitor.active = state.global_step % self.config.every_n_steps == 0

    def on_log(self, args, state, control, logs=None, **kwargs):
        if self.monitor is None or logs is None or "loss" not in logs:  # training logs only, not eval's
            return
        figures = self.monitor.flush()
        for alarm in self.monitor.alarms(figures):
            logger.warning("rpb routing alarm at step %d: %s", state.global_step, alarm)
            figures["routing/alarm"] = figures.get("routing/alarm", 0.0) + 1.0
            if self.config.stop_on_alarm:
                control.should_training_stop = True
        logs.update(figures)
        entry = state.log_history[-1] if state.log_history else None
        # the copy Trainer.log appended for this very call: its loss is the same object as the logs'
        if entry is not None and entry.get("step") == state.global_step and entry.get("loss") is logs["loss"]:
            entry.update(figures)

    def on_train_end(self, args, state, control, **kwargs):
        if self.monitor is not None:
            self.monitor.remove()


def fsdp1(args) -> bool:
    """The Trainer wraps the model with FSDP1, whose flat parameters hide each router's weight (version 2 shards
    them as DTensors, which the monitor gathers)."""
    return bool(getattr(args, "fsdp", None)) and (getattr(args, "fsdp_config", None) or {}).get("version", 1) == 1


def attach_default_monitor(trainer, config: MonitorConfig | None = None) -> RoutingMonitorCallback | None:
    """A trainer's own monitor (``MonitorConfig.enabled``): asked for, or, unasked, where the trainer's rpb anchor has
    the base's routing at hand (``routing-kd``). Unasked, it stays off under FSDP1 with one line in the log, so a
    set-up that runs without it never becomes a refusal; asked for, FSDP1 is refused when training starts."""
    config = config or MonitorConfig()
    anchor = getattr(trainer, "anchor", None)
    if config.enabled is False:
        return None
    if config.enabled is None:
        if anchor is None or getattr(anchor, "overlap", None) is None:
            return None
        if fsdp1(trainer.args):
            logger.info(
                "rpb monitor: off under FSDP1, whose flat parameters hide the routers' weights; under FSDP2 "
                '(fsdp_config {"version": 2}) it is on'
            )
            return None
    return attach_monitor(trainer, config, anchor.facts.model_type if anchor is not None else None)


def attach_monitor(trainer, config: MonitorConfig | None = None, adapter: str | None = None) -> RoutingMonitorCallback:
    """Add the monitor to a built Trainer, first among its callbacks (reading the routers through the trainer's
    rpb anchor when it has one); returns the callback."""
    callback = RoutingMonitorCallback(config, adapter, getattr(trainer, "anchor", None))
    trainer.callback_handler.callbacks.insert(0, callback)
    return callback
