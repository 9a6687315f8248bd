"""Injected time: the scheduler and the quota buckets read a Clock, never the system time.

Monotonic seconds, so wall-clock jumps (NTP, DST) cannot refill a bucket or expire a deadline.
"""

from __future__ import annotations

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
