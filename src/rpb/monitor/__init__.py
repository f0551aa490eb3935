"""Routing health for any MoE fine-tune: how far the routers drift from the frozen base while training.

``RoutingMonitor`` (plain PyTorch) keeps a frozen copy of the base's routers and, over the loss tokens of
every observed forward, compares the current routers' choice with the base routers' on the same hidden
states; ``attach_monitor(trainer)`` puts it into a Hugging Face / TRL Trainer's logs (docs/monitor.md).
"""

from rpb.monitor.callback import RoutingMonitorCallback, attach_monitor
from rpb.monitor.routing import FIGURES, MonitorConfig, RoutingMonitor

__all__ = ["FIGURES", "MonitorConfig", "RoutingMonitor", "RoutingMonitorCallback", "attach_monitor"]
