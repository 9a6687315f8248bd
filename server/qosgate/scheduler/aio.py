"""The scheduler as the asyncio edge uses it: `async with scheduler.slot(...) as dispatch:`.

Cheap on the hot path: a request that finds room in the window never touches the event
loop; a queued one waits on its own Future, resolved exactly when the core hands it a slot
(no tasks, no polling), with one timer handle for its deadline.
"""

from __future__ import annotations

import asyncio
from collections.abc import Coroutine, Sequence
from dataclasses import dataclass
from types import TracebackType

from qosgate.auth import Tenant
from qosgate.clock import Clock
from qosgate.config import GatewayConfig
from qosgate.errors import DeadlineExceeded
from qosgate.scheduler.core import SchedulerSnapshot, SchedulingCore, Waiter, WaiterState


@dataclass(frozen=True, slots=True)
class Dispatch:
    """A granted slot: how long the request waited and the Triton priority level to send."""

    queue_wait_s: float
    priority_level: int


class Scheduler:
    """Per-model dispatch windows with class priority and tenant fair share, for asyncio.

    Must be used from one event loop (the core is not thread-safe).
    """

    def __init__(self, config: GatewayConfig, clock: Clock) -> None:
        self._core = SchedulingCore(config)
        self._clock = clock

    def slot(self, *, tenant: Tenant, klass: str, model: str, deadline: float | None) -> _Slot:
        """Wait for a dispatch slot of `model`; leaving the context frees it.

        `deadline` is on the scheduler's clock. Raises DeadlineExceeded if it passes while
        queued, Unavailable if the request is shed or its queue is full, InvalidArgument for
        an unknown class. A waiter cancelled while queued is removed from its queue.
        """
        return _Slot(self, Waiter(tenant.name, tenant.weight, klass, model, deadline, 0.0))

    def snapshot(self) -> SchedulerSnapshot:
        return self._core.snapshot()

    async def _acquire(self, waiter: Waiter) -> Dispatch:
        core = self._core
        now = self._clock.now()
        waiter.arrived_at = now
        level = core.level(waiter.klass) + 1
        self._settle(core.submit(waiter, now))
        # Not narrowed by an `if` on the state: the await below changes it behind mypy's back.
        dispatched_at_once = waiter.state is WaiterState.DISPATCHED
        if dispatched_at_once:
            return Dispatch(queue_wait_s=0.0, priority_level=level)
        loop = asyncio.get_running_loop()
        future = waiter.future = loop.create_future()
        timer = None
        if waiter.deadline is not None:
            timer = loop.call_later(waiter.deadline - now, self._expire, waiter)
        try:
            await future
        except asyncio.CancelledError:
            if not core.withdraw(waiter) and waiter.state is WaiterState.DISPATCHED:
                # Granted a slot in the same instant it was cancelled: hand it on.
                self._release(waiter)
            raise
        finally:
            if timer is not None:
                timer.cancel()
        return Dispatch(queue_wait_s=self._clock.now() - waiter.arrived_at, priority_level=level)

    def _release(self, waiter: Waiter) -> None:
        self._settle(self._core.release(waiter.model, self._clock.now()))

    def _settle(self, decided: Sequence[Waiter]) -> None:
        for waiter in decided:
            future = waiter.future
            if future is None or future.done():
                # Its coroutine was cancelled meanwhile; `_acquire` cleans up.
                continue
            if waiter.error is not None:
                future.set_exception(waiter.error)
            else:
                future.set_result(None)

    def _expire(self, waiter: Waiter) -> None:
        if self._core.withdraw(waiter) and waiter.future is not None and not waiter.future.done():
            waiter.future.set_exception(
                DeadlineExceeded("deadline exceeded while queued in the gateway")
            )


class _Slot:
    """The async context manager returned by `Scheduler.slot`."""

    __slots__ = ("_scheduler", "_waiter")

    def __init__(self, scheduler: Scheduler, waiter: Waiter) -> None:
        self._scheduler = scheduler
        self._waiter = waiter

    def __aenter__(self) -> Coroutine[None, None, Dispatch]:
        return self._scheduler._acquire(self._waiter)

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self._scheduler._release(self._waiter)
