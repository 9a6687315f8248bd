"""Who goes next: class priority with a floor, tenant fair share, per-model dispatch windows."""

from qosgate.scheduler.aio import Dispatch, Scheduler
from qosgate.scheduler.core import SchedulerSnapshot, SchedulingCore, Waiter, WaiterState

__all__ = ["Dispatch", "Scheduler", "SchedulerSnapshot", "SchedulingCore", "Waiter", "WaiterState"]
