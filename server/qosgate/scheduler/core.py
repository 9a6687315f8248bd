"""The scheduling core: pure, synchronous, driven by the caller's `now`.

Per model: one queue per class, and inside each class one FIFO per tenant.
- Between classes: strict priority, except that every lower class earns a credit of its
  floor share on each dispatch while it has work; a class whose credit reaches 1 is served
  next. A class with floor f thus gets at least a fraction f of dispatches while it waits.
- Between tenants of a class: start-time fair queueing (virtual time). Each dispatch
  advances a tenant's tag by 1/weight, the tenant with the smallest tag goes next, and a
  tenant that was idle re-enters at the class's current virtual time (no banked credit).
- A dispatch window per model caps requests in flight upstream; the rest wait here.
  Lower classes may fill only part of it (nested reservations, `window_reserve`): a class
  dispatches while fewer than its own limit are in flight, so the slots above a lower
  class's limit stay free for the classes above it. A class whose floor credit is due
  may use the whole window, or a flood of higher classes could starve it.
- Bounded queues per class; under overload (too many queued for a model) the newest
  request of the busiest tenant in the lowest sheddable class below the arrival is shed.
- A request whose deadline has passed is dropped instead of dispatched.

Removal from the middle of a queue (cancel, deadline) is lazy: the waiter is marked and
skipped when it reaches the head, so every operation is O(1) in the queue length.
"""

from __future__ import annotations

import enum
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from qosgate.config import GatewayConfig
from qosgate.errors import DeadlineExceeded, GatewayError, InvalidArgument, Unavailable

if TYPE_CHECKING:
    import asyncio

# Floor credits are sums of float shares; without a tolerance 20 x 0.05 may fall short of 1.
_CREDIT_EPSILON = 1e-9
_NOTHING: tuple[Waiter, ...] = ()


class WaiterState(enum.Enum):
    PENDING = "pending"
    QUEUED = "queued"
    DISPATCHED = "dispatched"
    DROPPED = "dropped"  # shed, expired or cancelled; `error` says why (None: cancelled)


@dataclass(slots=True, eq=False)
class Waiter:
    """One request asking for a dispatch slot of `model`."""

    tenant: str
    weight: float
    klass: str
    model: str
    deadline: float | None
    arrived_at: float
    state: WaiterState = WaiterState.PENDING
    error: GatewayError | None = None
    # The async wrapper's handle on the waiting coroutine; the core never touches it.
    future: asyncio.Future[None] | None = field(default=None, repr=False)


@dataclass(slots=True, eq=False)
class _TenantQueue:
    name: str
    weight: float = 1.0
    waiters: deque[Waiter] = field(default_factory=deque)
    live: int = 0
    # Virtual start tag of the head request; meaningful only while live > 0.
    start: float = 0.0
    finish: float = 0.0

    def head(self) -> Waiter:
        waiters = self.waiters
        while waiters[0].state is not WaiterState.QUEUED:
            waiters.popleft()
        return waiters[0]

    def newest(self) -> Waiter:
        waiters = self.waiters
        while waiters[-1].state is not WaiterState.QUEUED:
            waiters.pop()
        return waiters[-1]


@dataclass(slots=True, eq=False)
class _ClassQueue:
    name: str
    floor: float
    window: int  # dispatch while fewer than this are in flight (its nested reservation)
    max_length: int
    sheddable: bool
    # Every tenant seen (so metrics see queues drain to 0); `backlogged` only those with
    # work, so picking the next tenant costs O(tenants waiting), not O(tenants ever seen).
    tenants: dict[str, _TenantQueue] = field(default_factory=dict)
    backlogged: dict[str, _TenantQueue] = field(default_factory=dict)
    live: int = 0
    vtime: float = 0.0
    credit: float = 0.0

    def push(self, waiter: Waiter) -> None:
        queue = self.tenants.get(waiter.tenant)
        if queue is None:
            queue = self.tenants[waiter.tenant] = _TenantQueue(waiter.tenant)
        queue.weight = waiter.weight
        if queue.live == 0:
            queue.start = max(self.vtime, queue.finish)
            self.backlogged[queue.name] = queue
        queue.waiters.append(waiter)
        queue.live += 1
        self.live += 1

    def _taken(self, queue: _TenantQueue) -> None:
        queue.live -= 1
        self.live -= 1
        if not queue.live:
            del self.backlogged[queue.name]
            queue.waiters.clear()  # only marked (withdrawn) waiters can be left

    def pop_fairest(self) -> Waiter:
        chosen = min(self.backlogged.values(), key=_start_tag)
        waiter = chosen.head()
        chosen.waiters.popleft()
        self.vtime = chosen.start
        chosen.finish = chosen.start + 1.0 / chosen.weight
        chosen.start = chosen.finish
        self._taken(chosen)
        return waiter

    def pop_victim(self) -> Waiter:
        """The newest request of the tenant with the most queued (ties: the most served)."""
        victim = max(self.backlogged.values(), key=_shedding_order)
        waiter = victim.newest()
        victim.waiters.pop()
        self._taken(victim)
        return waiter

    def forget(self, waiter: Waiter) -> None:
        """Account for a waiter removed lazily (it stays in the deque, marked, until skipped)."""
        self._taken(self.tenants[waiter.tenant])


def _start_tag(queue: _TenantQueue) -> float:
    return queue.start


def _shedding_order(queue: _TenantQueue) -> tuple[int, float]:
    return (queue.live, queue.start)


@dataclass(slots=True, eq=False)
class _ModelQueues:
    window: int
    max_queued: int
    classes: list[_ClassQueue]  # highest first
    in_flight: int = 0
    queued: int = 0

    def pop_next(self) -> Waiter | None:
        """Strict priority among the classes whose share of the window has room, overridden
        by a lower class whose floor credit has come due; None if no class may dispatch."""
        top: _ClassQueue | None = None
        due: _ClassQueue | None = None
        for queue in self.classes:
            if not queue.live:
                queue.credit = 0.0  # no banking of share while idle
                continue
            if top is None and self.in_flight < queue.window:
                top = queue
            credit = queue.credit + queue.floor
            if credit >= 1.0 - _CREDIT_EPSILON and (due is None or credit > due.credit + due.floor):
                due = queue
        chosen = due or top
        if chosen is None:
            return None
        # Credit accrues per dispatch made, not per slot offered and left unused.
        for queue in self.classes:
            if queue.live:
                queue.credit += queue.floor
        chosen.credit = max(0.0, chosen.credit - 1.0)
        self.queued -= 1
        return chosen.pop_fairest()


@dataclass(frozen=True, slots=True)
class SchedulerSnapshot:
    """Queue depth per (model, class, tenant) and requests in flight per model, for metrics."""

    queued: dict[tuple[str, str, str], int]
    in_flight: dict[str, int]


class SchedulingCore:
    """Decides which waiter gets a model's next dispatch slot. Not thread-safe: one owner."""

    def __init__(self, config: GatewayConfig) -> None:
        self._config = config
        self._levels = {klass: i for i, klass in enumerate(config.classes)}
        self._sheddable = frozenset(config.sheddable_classes())
        self._models: dict[str, _ModelQueues] = {}

    def _queues(self, model: str) -> _ModelQueues:
        queues = self._models.get(model)
        if queues is None:
            config = self._config
            policy = config.model_policy(model)
            queues = self._models[model] = _ModelQueues(
                window=policy.dispatch_window,
                max_queued=policy.max_queued,
                classes=[
                    _ClassQueue(
                        name=klass,
                        floor=config.floor_share(klass),
                        window=config.class_window(klass, policy.dispatch_window),
                        max_length=config.max_queue_length(klass),
                        sheddable=klass in self._sheddable,
                    )
                    for klass in config.classes
                ],
            )
        return queues

    def level(self, klass: str) -> int:
        """Position of a class, 0 for the highest; InvalidArgument if unknown."""
        level = self._levels.get(klass)
        if level is None:
            raise InvalidArgument(f"unknown priority class {klass!r}")
        return level

    def submit(self, waiter: Waiter, now: float) -> Sequence[Waiter]:
        """Dispatch `waiter` at once if the window has room, else queue it.

        Returns other waiters this decided (shed to make room, state DROPPED with `error`).
        Raises Unavailable (queue full or overload with nothing to shed) or DeadlineExceeded.
        """
        level = self.level(waiter.klass)
        model = self._queues(waiter.model)
        klass = model.classes[level]
        # Nothing of this class or above can be queued while in_flight is below this
        # class's limit (release() fills every class up to its limit), so room suffices.
        if model.in_flight < klass.window:
            model.in_flight += 1
            waiter.state = WaiterState.DISPATCHED
            return _NOTHING
        if waiter.deadline is not None and waiter.deadline <= now:
            raise DeadlineExceeded("deadline exceeded before the request could be queued")
        retry = self._config.scheduler.shed_retry_after_s
        if klass.live >= klass.max_length:
            raise Unavailable(
                f"queue of class {klass.name!r} for model {waiter.model!r} is full", retry
            )
        shed = _NOTHING
        if model.queued >= model.max_queued:
            victim_class = next(
                (c for c in reversed(model.classes[level + 1 :]) if c.sheddable and c.live),
                None,
            )
            if victim_class is None:
                raise Unavailable(f"model {waiter.model!r} is overloaded", retry)
            victim = victim_class.pop_victim()
            model.queued -= 1
            victim.state = WaiterState.DROPPED
            victim.error = Unavailable(
                f"shed under overload: class {victim_class.name!r} yields to higher classes", retry
            )
            shed = (victim,)
        klass.push(waiter)
        model.queued += 1
        waiter.state = WaiterState.QUEUED
        return shed

    def release(self, model_name: str, now: float) -> Sequence[Waiter]:
        """A dispatched request of `model_name` finished: refill its window.

        Returns the waiters decided: DISPATCHED ones, and DROPPED ones whose deadline had
        passed (with a DeadlineExceeded `error`).
        """
        model = self._models[model_name]
        model.in_flight -= 1
        if not model.queued:
            return _NOTHING
        decided: list[Waiter] = []
        while model.in_flight < model.window and model.queued:
            waiter = model.pop_next()
            if waiter is None:
                break
            if waiter.deadline is not None and waiter.deadline <= now:
                waiter.state = WaiterState.DROPPED
                waiter.error = DeadlineExceeded("deadline exceeded while queued in the gateway")
            else:
                model.in_flight += 1
                waiter.state = WaiterState.DISPATCHED
            decided.append(waiter)
        return decided

    def withdraw(self, waiter: Waiter) -> bool:
        """Remove a queued waiter (cancelled or timed out); False if it was no longer queued."""
        if waiter.state is not WaiterState.QUEUED:
            return False
        waiter.state = WaiterState.DROPPED
        model = self._models[waiter.model]
        model.classes[self._levels[waiter.klass]].forget(waiter)
        model.queued -= 1
        return True

    def snapshot(self) -> SchedulerSnapshot:
        queued: dict[tuple[str, str, str], int] = {}
        for model_name, model in self._models.items():
            for klass in model.classes:
                for tenant in klass.tenants.values():
                    queued[(model_name, klass.name, tenant.name)] = tenant.live
        return SchedulerSnapshot(
            queued=queued, in_flight={name: m.in_flight for name, m in self._models.items()}
        )
