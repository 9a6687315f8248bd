"""Injected time: the scheduler and the quota buckets read a Clock, never the system time.

Monotonic seconds, so wall-clock jumps (NTP, DST) cannot refill a bucket or expire a deadline.
Wall time (Unix seconds, injected as a callable) only names days: `utc_day`.
"""

from __future__ import annotations

import datetime as dt
import time
from typing import Protocol


class Clock(Protocol):
    """A source of monotonic time in seconds; only differences between readings mean anything."""

    def now(self) -> float: ...


class MonotonicClock:
    """The real clock: `time.monotonic`, the same base asyncio's event loop uses."""

    __slots__ = ()

    def now(self) -> float:
        return time.monotonic()


DAY_S = 86_400.0


def utc_day(wall_time: float) -> str:
    """The UTC day of a Unix time as YYYY-MM-DD: the unit of daily budgets and usage."""
    return dt.datetime.fromtimestamp(wall_time, dt.UTC).strftime("%Y-%m-%d")
