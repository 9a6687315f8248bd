"""The scheduling core: pure, synchronous, driven by the caller's `now`.

Per model: one queue per class, and inside each class one queue per tenant (first come,
first served until it stands; see below).
- Between classes: strict priority, except that every lower class earns a credit of its
  floor share on each dispatch while it has work; a class whose credit reaches 1 is served
  next. A class with floor f thus gets at least a fraction f of dispatches while it waits.
- Between tenants of a class: start-time fair queueing (virtual time) on each request's
  cost, in the manner of VTC ("Fairness in Serving Large Language Models", OSDI'24): each
  dispatch advances a tenant's tag by cost/weight, the tenant with the smallest tag goes
  next, and a tenant that was idle re-enters at the class's current virtual time, the
  tag of the least-served backlogged tenant (no banked credit; one whose queue ran dry
  while its requests were in flight keeps up to their service). The cost is an estimate
  at dispatch (an LLM request: prompt + w x max_tokens); `settle` corrects the tag with
  the real cost when the request finishes. With `fair_share: requests` every cost is 1.
- A dispatch window per model caps requests in flight upstream; the rest wait here. The
  window may move (`resize`: the self-sizing window of a model set to `auto`).
  Lower classes may fill only part of it (nested reservations, `window_reserve`): a class
  dispatches while fewer than its own limit are in flight, so the slots above a lower
  class's limit stay free for the classes above it. Lower-class work over its limit
  (the window shrank under it) does not take those slots: a class counts the classes
  below it only up to their limits, so a critical request never waits for batch work
  admitted under a larger window to finish. A class whose floor credit is due may use
  the whole window, or a flood of higher classes could starve it.
- A model's exclusive classes (`exclusive_classes`) hold the classes below them while
  they have a request in flight: on an engine that runs one batch at a time, lower-class
  work sent meanwhile would join that request's batch or start one before it. A due
  floor overrides this too.
- Bounded queues per class; under overload (too many queued for a model) the busiest
  tenant in the lowest sheddable class below the arrival sheds the request it would
  dispatch last (its newest, or while its queue stands its oldest).
- A request whose deadline has passed is dropped instead of dispatched.
- A tenant's queue is FIFO until it stands: once its oldest request has waited more than
  STANDING of its time to its deadline, the tenant's next dispatch takes its newest
  request instead (adaptive LIFO). Under an overload that lasts, a FIFO hands the engine
  only requests about to expire, which die mid-work; the newest has its whole deadline
  left to finish in, and the old ones expire in the queue, where they cost nothing.
- A tenant's in-flight tokens (`max_inflight_tokens`) are capped: its requests wait
  queued while dispatching the next would exceed the cap; other tenants pass them.

Removal from the middle of a queue (cancel, deadline) is lazy: the waiter is marked and
skipped when it reaches the head, so every operation is O(1) in the queue length.
"""

from __future__ import annotations

import enum
from collections import deque
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from qosgate.config import GatewayConfig
from qosgate.scheduler.classes import class_window, initial_window, sheddable_classes
from qosgate.scheduler.cluster import ALONE, ClusterView, GatewayReport, TenantShare
from qosgate.scheduler.window import FairCaps, Pressure, TenantDemand
from qosgate.errors import (
    DeadlineExceeded,
    GatewayError,
    InvalidArgument,
    QuotaExceeded,
    QuotaViolation,
    Unavailable,
)

if TYPE_CHECKING:
    import asyncio

# Floor credits are sums of float shares; without a tolerance 20 x 0.05 may fall short of 1.
_CREDIT_EPSILON = 1e-9
_NO_CAP = 1 << 30  # a short int for compiled code, far above any window
_NOTHING: tuple[Waiter, ...] = ()
# A tenant's queue stands (its next dispatch takes its newest request) while its oldest
# has waited more than this fraction of the time it had to its deadline.
STANDING = 0.5


class WaiterState(enum.Enum):
    PENDING = "pending"
    QUEUED = "queued"
    DISPATCHED = "dispatched"
    DROPPED = "dropped"  # shed, expired or cancelled; `error` says why (None: cancelled)


@dataclass(slots=True, eq=False, init=False)
class Waiter:
    """One request asking for a dispatch slot of `model`."""

    tenant: str
    weight: float
    klass: str
    model: str
    deadline: float | None
    arrived_at: float
    # What a dispatch charges the tenant's fair-share tag (before dividing by its weight).
    cost: float
    # Tokens it holds at the engine while in flight, against `token_quota` (None: no cap).
    tokens: int
    token_quota: int | None
    dispatched_at: float  # on the core's clock; meaningful once DISPATCHED
    state: WaiterState
    error: GatewayError | None
    # The async wrapper's handle on the waiting coroutine; the core never touches it.
    future: asyncio.Future[None] | None = field(repr=False)

    # Written out (init=False), one per call: the `__init__` that `dataclasses` generates
    # is interpreted even in a compiled module.
    def __init__(
        self,
        tenant: str,
        weight: float,
        klass: str,
        model: str,
        deadline: float | None,
        arrived_at: float,
        cost: float = 1.0,
        tokens: int = 0,
        token_quota: int | None = None,
    ) -> None:
        self.tenant = tenant
        self.weight = weight
        self.klass = klass
        self.model = model
        self.deadline = deadline
        self.arrived_at = arrived_at
        self.cost = cost
        self.tokens = tokens
        self.token_quota = token_quota
        self.dispatched_at = 0.0
        self.state = WaiterState.PENDING
        self.error = None
        self.future = None


@dataclass(slots=True, eq=False)
class _TenantQueue:
    name: str
    weight: float = 1.0
    waiters: deque[Waiter] = field(default_factory=deque)
    live: int = 0
    # Virtual start tag of the head request; meaningful only while live > 0.
    start: float = 0.0
    finish: float = 0.0
    in_flight: int = 0
    # Of its requests that ended: their seconds in flight and their cost, how long its
    # requests occupy the engine per unit of service, for the window's fair-share caps.
    ended_s: float = 0.0
    ended_cost: float = 0.0
    # Cost charged to it at dispatch (settles included), what other gateways read; and
    # what they reported charging it, as last taken into its tags.
    charged: float = 0.0
    remote: float = 0.0
    # Requests dispatched so far: how many the charged service was measured on.
    dispatched: int = 0

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

    def stands(self, now: float) -> bool:
        """Whether its oldest request has waited past STANDING of its time to its deadline
        (one already expired does not count: it goes first, to be dropped)."""
        head = self.head()
        deadline = head.deadline
        return deadline is not None and now < deadline and now - head.arrived_at > STANDING * (deadline - head.arrived_at)

    def next(self, now: float) -> Waiter:
        """The request its next dispatch takes: the oldest, or the newest while the queue
        stands (see the module)."""
        return self.newest() if self.stands(now) else self.head()

    def last(self, now: float) -> Waiter:
        """The request it would dispatch last, the one to shed: the newest, or the oldest
        while the queue stands."""
        return self.head() if self.stands(now) else self.newest()

    def take(self, waiter: Waiter) -> None:
        """Remove `waiter`, one of its ends (as `next` or `last` returned it)."""
        if self.waiters[0] is waiter:
            self.waiters.popleft()
        else:
            self.waiters.pop()


@dataclass(slots=True, eq=False)
class _ClassQueue:
    name: str
    floor: float
    window: int  # its nested reservation of the model's window
    max_length: int
    sheddable: bool
    # Dispatch while fewer than this are in flight (nested: the classes above and, up to
    # their own limits, below it count): its reservation, or less while the window's
    # controller holds it back for a higher class's latency objective.
    limit: int = 0
    # And while fewer than this of its own are (the window's fair-share cap), each
    # competing tenant while it has fewer than its part of it.
    own_cap: int = _NO_CAP
    tenant_caps: dict[str, int] = field(default_factory=dict)
    # Every tenant seen (so metrics see queues drain to 0); `backlogged` only those with
    # work, so picking the next tenant costs O(tenants waiting), not O(tenants ever seen).
    tenants: dict[str, _TenantQueue] = field(default_factory=dict)
    backlogged: dict[str, _TenantQueue] = field(default_factory=dict)
    live: int = 0
    vtime: float = 0.0
    credit: float = 0.0
    in_flight: int = 0

    def tenant(self, waiter: Waiter) -> _TenantQueue:
        """The queue of `waiter`'s tenant, made on first use with its current weight."""
        queue = self.tenants.get(waiter.tenant)
        if queue is None:
            queue = self.tenants[waiter.tenant] = _TenantQueue(waiter.tenant)
        queue.weight = waiter.weight
        return queue

    def push(self, waiter: Waiter) -> None:
        queue = self.tenant(waiter)
        if queue.live == 0:
            # An idle tenant re-enters at the class's virtual time: no banked credit. One
            # with requests in flight is not idle: its queue ran dry for as long as its
            # answers took to come back as new requests (a caller's turnaround), and being
            # lifted each time would cost it its weight. It keeps up to the service of what
            # it has in flight.
            floor = self.vtime - queue.in_flight * waiter.cost / queue.weight
            queue.start = max(floor, queue.finish)
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

    def fairest(self, fits: Callable[[Waiter], bool], now: float) -> _TenantQueue | None:
        """The backlogged tenant with the smallest tag whose next request `fits`."""
        best: _TenantQueue | None = None
        for queue in self.backlogged.values():
            if (best is None or queue.start < best.start) and fits(queue.next(now)):
                best = queue
        return best

    def pop_from(self, chosen: _TenantQueue, now: float) -> Waiter:
        waiter = chosen.next(now)
        chosen.take(waiter)
        self.vtime = chosen.start
        chosen.finish = chosen.start + waiter.cost / chosen.weight
        chosen.start = chosen.finish
        self._taken(chosen)
        return waiter

    def charge_at_once(self, waiter: Waiter) -> None:
        """Charge a request dispatched without queueing (nothing of its class was waiting).

        The class's virtual time follows it, so a tenant arriving later is lifted to the
        level of those served meanwhile instead of banking the time it was away.
        """
        queue = self.tenant(waiter)
        start = max(self.vtime, queue.finish)
        self.vtime = start
        queue.finish = queue.start = start + waiter.cost / queue.weight

    def has_queued(self, tenant: str) -> bool:
        queue = self.backlogged.get(tenant)
        return queue is not None

    def correct(self, waiter: Waiter, delta: float) -> None:
        """Move the tenant's tags by a dispatched request's cost correction."""
        self.shift(self.tenants[waiter.tenant], delta)
        self.tenants[waiter.tenant].charged += delta

    @staticmethod
    def shift(queue: _TenantQueue, cost: float) -> None:
        """Move a tenant's tags by `cost` more (or less) service."""
        shift = cost / queue.weight
        queue.finish += shift
        if queue.live:
            queue.start += shift

    def pop_victim(self, now: float) -> Waiter:
        """The request the tenant with the most queued (ties: the most served) would
        dispatch last."""
        victim = max(self.backlogged.values(), key=_shedding_order)
        waiter = victim.last(now)
        victim.take(waiter)
        self._taken(victim)
        return waiter

    def forget(self, waiter: Waiter) -> None:
        """Account for a waiter removed lazily (it stays in the deque, marked, until skipped)."""
        self._taken(self.tenants[waiter.tenant])


def _shedding_order(queue: _TenantQueue) -> tuple[int, float]:
    return (queue.live, queue.start)


@dataclass(slots=True, eq=False)
class _ModelQueues:
    window: int
    max_queued: int
    classes: list[_ClassQueue]  # highest first
    # Levels of the exclusive classes, highest first: each holds the classes below it.
    exclusive: tuple[int, ...] = ()
    in_flight: int = 0
    queued: int = 0

    def held(self, level: int) -> bool:
        """Whether an exclusive class above `level` has a request in flight."""
        for top in self.exclusive:
            if top >= level:
                return False
            if self.classes[top].in_flight:
                return True
        return False

    def may_dispatch(self, level: int) -> bool:
        """Whether class `level` may dispatch now (its floor aside)."""
        return self.has_room(level) and not (self.exclusive and self.held(level))

    def has_room(self, level: int) -> bool:
        """Whether class `level`'s share of the window has room: what is in flight is below
        its nested limit, counting the classes below it only up to what their own limits let
        them hold. So after the window shrinks, lower-class work still in flight over those
        limits drains without taking the slots reserved for the classes above (in flight may
        then exceed the window by at most those reserved slots)."""
        klass = self.classes[level]
        return klass.in_flight < klass.own_cap and self._taken(level) < klass.limit

    def _taken(self, level: int) -> int:
        """What counts against class `level`'s limit: the requests in flight of the classes
        up to it, and of those below it up to their own limits."""
        classes = self.classes
        below = 0
        for klass in reversed(classes[level + 1 :]):
            below = min(below + klass.in_flight, klass.limit)
        taken = below
        for klass in classes[: level + 1]:
            taken += klass.in_flight
        return taken

    def window_limits(self, level: int) -> bool:
        """Whether class `level` asks for more than its nested reservation of the window:
        its requests in flight and queued (with what counts against its limit) exceed it.
        Its fair-share cap aside: the window is the engine's, sized for what is asked of it,
        and a cap splits it between tenants. Not while a higher class's latency objective
        holds it below its reservation (a larger window would not let it go)."""
        klass = self.classes[level]
        return klass.live > 0 and klass.limit >= klass.window and self._taken(level) + klass.live > klass.window

    def pop_next(self, fits: Callable[[Waiter], bool], now: float) -> Waiter | None:
        """Strict priority among the classes whose share of the window has room, overridden
        by a lower class whose floor credit has come due; None if no class may dispatch.
        Only requests that `fits` (their tenant's in-flight tokens) are considered."""
        top: tuple[_ClassQueue, _TenantQueue] | None = None
        due: tuple[_ClassQueue, _TenantQueue] | None = None
        due_credit = 0.0
        below_window = self.in_flight < self.window
        for level, queue in enumerate(self.classes):
            if not queue.live:
                queue.credit = 0.0  # no banking of share while idle
                continue
            credit = queue.credit + queue.floor
            is_due = below_window and credit >= 1.0 - _CREDIT_EPSILON and (due is None or credit > due_credit)
            wants_top = top is None and self.may_dispatch(level)
            if not (is_due or wants_top):
                continue
            tenant = queue.fairest(fits, now)
            if tenant is None:
                continue
            if wants_top:
                top = (queue, tenant)
            if is_due:
                due, due_credit = (queue, tenant), credit
        chosen = due or top
        if chosen is None:
            return None
        # Credit accrues per dispatch made, not per slot offered and left unused.
        for queue in self.classes:
            if queue.live:
                queue.credit += queue.floor
        klass, tenant = chosen
        klass.credit = max(0.0, klass.credit - 1.0)
        self.queued -= 1
        return klass.pop_from(tenant, now)


@dataclass(frozen=True, slots=True)
class SchedulerSnapshot:
    """Queue depth per (model, class, tenant), requests in flight and window per model, the
service each tenant attained, and the classes held below their share, for metrics."""

    queued: dict[tuple[str, str, str], int]
    in_flight: dict[str, int]
    window: dict[str, int]
    # Cost of the requests each (model, tenant) finished: weighted tokens for an LLM.
    served: dict[tuple[str, str], float]
    # Per (model, class) held below its share of the window (an `auto` window's fair-share
    # or latency-objective cap): what it may have in flight.
    capped: dict[tuple[str, str], int]


# A model with no `models:` entry gets its queues on first use. A tenant sending made-up
# model names must not grow that state without bound: past this many such models, the idle
# ones (nothing queued or in flight) are forgotten, least recently created first.
MAX_UNCONFIGURED_MODELS = 64


class SchedulingCore:
    """Decides which waiter gets a model's next dispatch slot. Not thread-safe: one owner."""

    def __init__(self, config: GatewayConfig) -> None:
        self._config = config
        self._levels = {klass: i for i, klass in enumerate(config.classes)}
        self._sheddable = frozenset(sheddable_classes(config))
        self._by_cost = config.scheduler.fair_share == "cost"
        self._models: dict[str, _ModelQueues] = {}
        self._tenant_tokens: dict[str, int] = {}  # tokens in flight, per tenant
        # From the other gateways sharing Redis (scheduler/cluster.py).
        self._limits: dict[tuple[str, int, str], int] = {}
        self._remote_tokens: dict[str, int] = {}
        # No other gateway's report last time (Redis unreachable, or none running): what
        # they serve meanwhile is not counted here, and their next reports are where
        # counting starts again.
        self._apart = False
        self._served: dict[tuple[str, str], float] = {}
        self._unconfigured: dict[str, None] = {}  # insertion-ordered set

    def _queues(self, model: str) -> _ModelQueues:
        queues = self._models.get(model)
        if queues is None:
            config = self._config
            policy = config.model_policy(model)
            window = initial_window(policy)
            queues = self._models[model] = _ModelQueues(
                window=window,
                max_queued=policy.max_queued,
                exclusive=tuple(sorted(self._levels[klass] for klass in set(policy.exclusive_classes))),
                classes=[
                    _ClassQueue(
                        name=klass,
                        floor=config.floor_share(klass),
                        window=class_window(config, klass, window),
                        max_length=config.max_queue_length(klass),
                        sheddable=klass in self._sheddable,
                    )
                    for klass in config.classes
                ],
            )
            for klass in queues.classes:
                klass.limit = klass.window
            if model not in config.models:
                self._unconfigured[model] = None
        return queues

    def forget_idle_models(self) -> tuple[str, ...]:
        """Forget idle models that have no `models:` entry while more than
        MAX_UNCONFIGURED_MODELS of them hold state; returns the names forgotten."""
        excess = len(self._unconfigured) - MAX_UNCONFIGURED_MODELS
        if excess <= 0:
            return ()
        forgotten = []
        for name in self._unconfigured:
            model = self._models[name]
            if model.in_flight == 0 and model.queued == 0:
                forgotten.append(name)
                if len(forgotten) == excess:
                    break
        for name in forgotten:
            del self._unconfigured[name]
            del self._models[name]
            for tenant in [t for m, t in self._served if m == name]:
                del self._served[(name, tenant)]
        return tuple(forgotten)

    def _fits(self, waiter: Waiter) -> bool:
        """Whether `waiter` may be dispatched: its tenant stays within its part of its
        class's fair cap, within what it may have in flight here while held back for
        another gateway's starved tenant, and within its in-flight token quota (counting
        what it holds at other gateways)."""
        level = self._levels[waiter.klass]
        klass = self._models[waiter.model].classes[level]
        if klass.tenant_caps:
            cap = klass.tenant_caps.get(waiter.tenant)
            if cap is not None and klass.tenant(waiter).in_flight >= cap:
                return False
        if self._limits:
            limit = self._limits.get((waiter.model, level, waiter.tenant))
            if limit is not None and klass.tenant(waiter).in_flight >= limit:
                return False
        quota = waiter.token_quota
        if quota is None:
            return True
        held = self._tenant_tokens.get(waiter.tenant, 0) + self._remote_tokens.get(waiter.tenant, 0)
        return held + waiter.tokens <= quota

    def cluster_report(self) -> GatewayReport:
        """What this gateway publishes to the others sharing its Redis."""
        tenants = [
            TenantShare(name, level, queue.name, queue.weight, queue.charged, queue.live + queue.in_flight, queue.live)
            for name, model in self._models.items()
            for level, klass in enumerate(model.classes)
            for queue in klass.tenants.values()
            if queue.charged or queue.live or queue.in_flight
        ]
        return GatewayReport(
            tenants=tenants,
            windows={name: model.window for name, model in self._models.items()},
            tokens={tenant: tokens for tenant, tokens in self._tenant_tokens.items() if tokens},
        )

    def cluster_apply(self, view: ClusterView, now: float) -> Sequence[Waiter]:
        """Take in what the other gateways reported: charge each tenant here for the
        service it got there since the last report, limit the tenants `view` holds back,
        count their tokens in flight there. Returns the waiters this lets go, as `release`
        does.

        After a time apart (`ALONE`: Redis did not answer), the others' totals include
        what they served meanwhile, while this gateway served by its own share: charged
        here at once, that would give the tenants served here the engine alone for as
        long as the outage lasted. So those first totals are only noted."""
        apart = view is ALONE
        if not apart:
            resuming = self._apart
            for name, model in self._models.items():
                for level, klass in enumerate(model.classes):
                    for queue in klass.tenants.values():
                        remote = view.remote_charged.get((name, level, queue.name), 0.0)
                        if remote > queue.remote and not resuming:
                            klass.shift(queue, remote - queue.remote)
                        queue.remote = remote  # a gateway gone takes its count with it
        self._apart = apart
        released = view.limits != self._limits
        self._limits = dict(view.limits)
        self._remote_tokens = dict(view.remote_tokens)
        decided: list[Waiter] = []
        if released or self._remote_tokens:
            for model in self._models.values():
                self._fill(model, now, decided)
        return decided

    def level(self, klass: str) -> int:
        """Position of a class, 0 for the highest; InvalidArgument if unknown."""
        level = self._levels.get(klass)
        if level is None:
            raise InvalidArgument(f"unknown priority class {klass!r}")
        return level

    def submit(self, waiter: Waiter, now: float) -> Sequence[Waiter]:
        """Dispatch `waiter` at once if the window has room, else queue it.

        Returns other waiters this decided (shed to make room, state DROPPED with `error`).
        Raises Unavailable (queue full or overload with nothing to shed), DeadlineExceeded,
        or QuotaExceeded (the request alone holds more tokens than its tenant's quota).
        """
        level = self.level(waiter.klass)
        if not self._by_cost:
            waiter.cost = 1.0
        if waiter.token_quota is not None and waiter.tokens > waiter.token_quota:
            raise QuotaExceeded(
                f"quota exceeded: the request holds {waiter.tokens} tokens (prompt + max_tokens), "
                f"more than max_inflight_tokens {waiter.token_quota}; lower max_tokens",
                self._config.scheduler.shed_retry_after_s,
                (QuotaViolation(f"tenant:{waiter.tenant}", "max_inflight_tokens"),),
            )
        model = self._queues(waiter.model)
        klass = model.classes[level]
        # Nothing of this class or above that could go is queued while in_flight is below
        # this class's limit and nothing holds it (every event that frees room or tokens,
        # or ends a hold, refills), so room, no hold, the tenant's token quota and its FIFO
        # order (nothing of it waiting) suffice.
        if (
            model.may_dispatch(level)
            and self._fits(waiter)
            and not klass.has_queued(waiter.tenant)
        ):
            klass.charge_at_once(waiter)
            self._dispatch(model, waiter, now)
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
            victim = victim_class.pop_victim(now)
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

    def _dispatch(self, model: _ModelQueues, waiter: Waiter, now: float) -> None:
        model.in_flight += 1
        klass = model.classes[self._levels[waiter.klass]]
        klass.in_flight += 1
        tenant = klass.tenant(waiter)
        tenant.in_flight += 1
        tenant.charged += waiter.cost
        tenant.dispatched += 1
        waiter.dispatched_at = now
        if waiter.tokens:
            self._tenant_tokens[waiter.tenant] = self._tenant_tokens.get(waiter.tenant, 0) + waiter.tokens
        waiter.state = WaiterState.DISPATCHED

    def settle(self, waiter: Waiter, cost: float) -> None:
        """A dispatched request's real cost is known (it finished): correct its tenant's tag
        by the difference from the estimate it was charged."""
        if waiter.state is not WaiterState.DISPATCHED or not self._by_cost:
            return
        model = self._models[waiter.model]
        model.classes[self._levels[waiter.klass]].correct(waiter, cost - waiter.cost)
        waiter.cost = cost

    def release(self, waiter: Waiter, now: float) -> Sequence[Waiter]:
        """A dispatched request finished: count its service, refill its model's window (and
        other models' where its tenant's freed tokens let a waiter go).

        Returns the waiters decided: DISPATCHED ones, and DROPPED ones whose deadline had
        passed (with a DeadlineExceeded `error`).
        """
        model = self._models[waiter.model]
        model.in_flight -= 1
        klass = model.classes[self._levels[waiter.klass]]
        klass.in_flight -= 1
        tenant = klass.tenant(waiter)
        tenant.in_flight -= 1
        tenant.ended_s += now - waiter.dispatched_at
        tenant.ended_cost += waiter.cost
        key = (waiter.model, waiter.tenant)
        self._served[key] = self._served.get(key, 0.0) + waiter.cost
        decided: list[Waiter] = []
        if waiter.tokens:
            self._tenant_tokens[waiter.tenant] -= waiter.tokens
            if waiter.token_quota is not None:
                for other in self._models.values():
                    if other is not model:
                        self._fill(other, now, decided)
        self._fill(model, now, decided)
        return decided

    def resize(
        self,
        model_name: str,
        window: int,
        now: float,
        *,
        fair: Mapping[int, FairCaps] | None = None,
        lower: Mapping[int, int] | None = None,
    ) -> Sequence[Waiter]:
        """Set a model's dispatch window and its classes' nested limits; by level, `fair`
        caps what a class and its competing tenants have in flight and `lower` the class's
        nested limit (classes not named have neither). More room dispatches waiters at
        once, returned as `release` returns them. Less takes effect as requests finish:
        nothing in flight is recalled."""
        model = self._queues(model_name)
        model.window = window
        for level, klass in enumerate(model.classes):
            klass.window = class_window(self._config, klass.name, window)
            cap = lower.get(level) if lower else None
            klass.limit = klass.window if cap is None else min(klass.window, cap)
            caps = fair.get(level) if fair else None
            klass.own_cap = _NO_CAP if caps is None else caps.total
            klass.tenant_caps = {} if caps is None else dict(caps.tenants)
        decided: list[Waiter] = []
        self._fill(model, now, decided)
        return decided

    def _fill(self, model: _ModelQueues, now: float, decided: list[Waiter]) -> None:
        while model.queued:
            waiter = model.pop_next(self._fits, now)
            if waiter is None:
                break
            if waiter.deadline is not None and waiter.deadline <= now:
                waiter.state = WaiterState.DROPPED
                waiter.error = DeadlineExceeded("deadline exceeded while queued in the gateway")
            else:
                self._dispatch(model, waiter, now)
            decided.append(waiter)

    def withdraw(self, waiter: Waiter) -> bool:
        """Remove a queued waiter (cancelled or timed out); False if it was no longer queued."""
        if waiter.state is not WaiterState.QUEUED:
            return False
        waiter.state = WaiterState.DROPPED
        model = self._models[waiter.model]
        model.classes[self._levels[waiter.klass]].forget(waiter)
        model.queued -= 1
        return True

    def pressure(self, model_name: str) -> Pressure:
        """What the model's window controller decides on: whether the window holds queued
        requests back (some class has work queued while its share of the window is full:
        a lower class never fills the whole window, the nested reservation keeps slots for
        the classes above), and each class's tenants with requests outstanding."""
        model = self._queues(model_name)
        tenants: dict[int, list[TenantDemand]] = {}
        share: dict[int, float] = {}
        for level, klass in enumerate(model.classes):
            share[level] = klass.window / max(1, model.window)
            outstanding = []
            for queue in klass.tenants.values():
                if queue.live or queue.in_flight:
                    outstanding.append(
                        TenantDemand(
                            queue.name,
                            queue.weight,
                            queue.live + queue.in_flight,
                            ended_s=queue.ended_s,
                            ended_cost=queue.ended_cost,
                            charged=queue.charged,
                            elsewhere=queue.remote,
                            dispatched=queue.dispatched,
                        )
                    )
            if outstanding:
                tenants[level] = outstanding
        return Pressure(
            limited=any(model.window_limits(level) for level in range(len(model.classes))),
            idle=model.in_flight == 0 and model.queued == 0,
            tenants=tenants,
            share=share,
        )

    def snapshot(self) -> SchedulerSnapshot:
        queued: dict[tuple[str, str, str], int] = {}
        for model_name, model in self._models.items():
            for klass in model.classes:
                for tenant in klass.tenants.values():
                    queued[(model_name, klass.name, tenant.name)] = tenant.live
        return SchedulerSnapshot(
            queued=queued,
            in_flight={name: m.in_flight for name, m in self._models.items()},
            window={name: m.window for name, m in self._models.items()},
            served=dict(self._served),
            capped={
                (name, klass.name): min(klass.limit, klass.own_cap)
                for name, model in self._models.items()
                for klass in model.classes
                if min(klass.limit, klass.own_cap) < klass.window
            },
        )
