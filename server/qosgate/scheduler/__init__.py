"""Who goes next: class priority with a floor, tenant fair share on each request's cost,
per-model dispatch windows (fixed or self-sizing)."""

from qosgate.scheduler.aio import Dispatch, Scheduler, Slot
from qosgate.scheduler.core import SchedulerSnapshot, SchedulingCore, Waiter, WaiterState
from qosgate.scheduler.window import EngineLoad, WindowController

__all__ = [
    "Dispatch",
    "EngineLoad",
    "Scheduler",
    "SchedulerSnapshot",
    "SchedulingCore",
    "Slot",
    "Waiter",
    "WaiterState",
    "WindowController",
]
