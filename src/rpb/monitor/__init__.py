"""Routing health for any MoE fine-tune: how far the routers drift from the frozen base while training.

``RoutingMonitor`` (plain PyTorch) keeps a frozen copy of the base's routers and, over the loss tokens of
every observed forward, compares the current routers' choice with the base routers' on the same hidden
states; ``attach_monitor(trainer)`` puts it into a Hugging Face / TRL Trainer's logs. ``audit(trainer)`` (and
``rpb audit``) runs two steps of a set-up and says what they really did to the routers (docs/monitor.md).
"""

from rpb.monitor.audit import asked_from_config, audit
from rpb.monitor.callback import RoutingMonitorCallback, attach_default_monitor, attach_monitor
from rpb.monitor.routing import FIGURES, MonitorConfig, RoutingMonitor
from rpb.monitor.verdict import Asked, AuditReport

__all__ = [
    "FIGURES",
    "Asked",
    "AuditReport",
    "MonitorConfig",
    "RoutingMonitor",
    "RoutingMonitorCallback",
    "asked_from_config",
    "attach_default_monitor",
    "attach_monitor",
    "audit",
]
