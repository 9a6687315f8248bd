"""The scheduler as the asyncio edge uses it: `async with scheduler.slot(...) as dispatch:`.

Cheap on the hot path: a request that finds room in the window never touches the event
loop; a queued one waits on its own Future, resolved exactly when the core hands it a slot
(no tasks, no polling), with one timer handle for its deadline.

Models with `dispatch_window: auto` have a WindowController each, fed by the dispatches'
first-response latency (`Dispatch.responded`), the engines' load (`engine_load`) and the
core's view of what waits (`SchedulingCore.pressure`); it is asked to decide as requests
finish and as engine readings arrive, and sets the window and the classes' caps.
"""

from __future__ import annotations

import asyncio
from collections.abc import Coroutine, Sequence
from types import TracebackType

from qosgate.auth import Tenant
from qosgate.clock import Clock
from qosgate.config import GatewayConfig
from qosgate.errors import DeadlineExceeded
from qosgate.scheduler.classes import class_window, initial_window
from qosgate.scheduler.cluster import ClusterShare, GatewayReport
from qosgate.scheduler.core import SchedulerSnapshot, SchedulingCore, Waiter, WaiterState
from qosgate.scheduler.window import EngineLoad, WindowController


# A window large enough that a class's nested share of it reads as a fraction.
_SHARE_OF = 1 << 20


class Dispatch:
    """A granted slot: how long the request waited and the Triton priority level to send;
    through it the call site reports the first response and the request's real cost."""

    __slots__ = ("_responded", "_scheduler", "_waiter", "dispatched_at", "priority_level", "queue_wait_s")

    def __init__(self, scheduler: Scheduler, waiter: Waiter, queue_wait_s: float, priority_level: int) -> None:
        self._scheduler = scheduler
        self._waiter = waiter
        self._responded = False
        self.queue_wait_s = queue_wait_s
        self.priority_level = priority_level
        self.dispatched_at = scheduler._clock.now()
        controller = scheduler._controller(waiter.model)
        if controller is not None:
            controller.dispatched(scheduler._core.level(waiter.klass), waiter, self.dispatched_at)

    def responded(self) -> None:
        """The engine's first response arrived: a latency sample for an `auto` window."""
        if not self._responded:
            self._responded = True
            self._scheduler._latency(self._waiter, self._scheduler._clock.now() - self.dispatched_at)

    def settle(self, cost: float) -> None:
        """The request's real cost (same unit as the `cost` it was scheduled with)."""
        self._scheduler._core.settle(self._waiter, cost)


class Scheduler:
    """Per-model dispatch windows with class priority and tenant fair share, for asyncio.

    Must be used from one event loop (the core is not thread-safe).
    """

    def __init__(self, config: GatewayConfig, clock: Clock) -> None:
        self._config = config
        self._core = SchedulingCore(config)
        self._clock = clock
        self._windows: dict[str, WindowController | None] = {}
        self._cluster = ClusterShare(
            {level: class_window(config, klass, _SHARE_OF) / _SHARE_OF for level, klass in enumerate(config.classes)}
        )

    def slot(
        self,
        *,
        tenant: Tenant,
        klass: str,
        model: str,
        deadline: float | None,
        cost: float = 1.0,
        tokens: int = 0,
    ) -> Slot:
        """Wait for a dispatch slot of `model`; leaving the context frees it.

        `cost` is the request's estimated fair-share cost (`Dispatch.settle` corrects it);
        `tokens` what it holds at the engine against the tenant's `max_inflight_tokens`.
        `deadline` is on the scheduler's clock. Raises DeadlineExceeded if it passes while
        queued, Unavailable if the request is shed or its queue is full, QuotaExceeded if
        it alone exceeds the tenant's in-flight tokens, InvalidArgument for an unknown
        class. A waiter cancelled while queued is removed from its queue.
        """
        waiter = Waiter(
            tenant.name,
            tenant.weight,
            klass,
            model,
            deadline,
            0.0,
            cost=cost,
            tokens=tokens,
            token_quota=tenant.limits.max_inflight_tokens if tokens else None,
        )
        return Slot(self, waiter)

    def snapshot(self) -> SchedulerSnapshot:
        return self._core.snapshot()

    def cluster_report(self) -> GatewayReport:
        """This gateway's report for the others sharing its Redis (scheduler/cluster.py)."""
        return self._core.cluster_report()

    def cluster_update(self, others: Sequence[GatewayReport]) -> None:
        """The other gateways' latest reports (none: alone, or Redis unreachable)."""
        now = self._clock.now()
        view = self._cluster.view(now, self._core.cluster_report(), others)
        self._resolve(self._core.cluster_apply(view, now))

    def engine_load(self, model: str, load: EngineLoad) -> None:
        """The engines' latest saturation reading for `model` (ignored unless it is `auto`)."""
        controller = self._controller(model)
        if controller is not None:
            controller.engine_load(load, self._clock.now())
            self._resize(model, controller)

    def _controller(self, model: str) -> WindowController | None:
        if model not in self._windows:
            config = self._config
            policy = config.model_policy(model)
            self._windows[model] = (
                WindowController(
                    policy.window_min,
                    policy.window_max,
                    initial_window(policy),
                    objectives={
                        config.classes.index(klass): objective
                        for klass, objective in config.scheduler.latency_objective.items()
                    },
                )
                if policy.dispatch_window == "auto"
                else None
            )
        return self._windows[model]

    def _latency(self, waiter: Waiter, seconds: float) -> None:
        controller = self._controller(waiter.model)
        if controller is not None:
            controller.latency(self._core.level(waiter.klass), seconds, self._clock.now(), key=waiter)

    def _resize(self, model: str, controller: WindowController) -> None:
        now = self._clock.now()
        if now < controller.next_at:
            return  # it acts once per interval: no need to gather what it would decide on
        decision = controller.decide(now, self._core.pressure(model))
        if decision is not None:
            self._resolve(self._core.resize(model, decision.window, now, fair=decision.fair, lower=decision.lower))

    async def _acquire(self, waiter: Waiter) -> Dispatch:
        dispatch = self._submit(waiter)
        return dispatch if dispatch is not None else await self._wait(waiter)

    def _submit(self, waiter: Waiter) -> Dispatch | None:
        """Queue `waiter`: its Dispatch if it went at once, else None (`_wait` for it)."""
        core = self._core
        now = self._clock.now()
        waiter.arrived_at = now
        level = core.level(waiter.klass) + 1  # InvalidArgument for an unknown class
        self._resolve(core.submit(waiter, now))
        if waiter.state is WaiterState.DISPATCHED:
            return Dispatch(self, waiter, 0.0, level)
        return None

    async def _wait(self, waiter: Waiter) -> Dispatch:
        """Wait for a queued `waiter`'s dispatch (see `slot` for how it fails)."""
        core = self._core
        level = core.level(waiter.klass) + 1
        loop = asyncio.get_running_loop()
        future = waiter.future = loop.create_future()
        timer = None
        if waiter.deadline is not None:
            timer = loop.call_later(waiter.deadline - waiter.arrived_at, self._expire, waiter)
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
        return Dispatch(self, waiter, self._clock.now() - waiter.arrived_at, level)

    def _release(self, waiter: Waiter) -> None:
        self._resolve(self._core.release(waiter, self._clock.now()))
        controller = self._controller(waiter.model)
        if controller is not None:
            controller.ended(self._core.level(waiter.klass), waiter)
            self._resize(waiter.model, controller)
        for model in self._core.forget_idle_models():
            self._windows.pop(model, None)

    def _resolve(self, decided: Sequence[Waiter]) -> None:
        for waiter in decided:
            future = waiter.future
            if future is None or future.done():
                # Its coroutine was cancelled meanwhile; `_wait` cleans up.
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


class Slot:
    """The async context manager returned by `Scheduler.slot`; `release` frees the slot
    before the context is left (once: leaving it then frees nothing more)."""

    __slots__ = ("_released", "_scheduler", "_waiter")

    def __init__(self, scheduler: Scheduler, waiter: Waiter) -> None:
        self._scheduler = scheduler
        self._waiter = waiter
        self._released = False

    def release(self) -> None:
        if not self._released:
            self._released = True
            self._scheduler._release(self._waiter)

    def __aenter__(self) -> Coroutine[None, None, Dispatch]:
        return self._scheduler._acquire(self._waiter)

    # `__aenter__` in two steps, for a caller that goes on at once when it need not wait.

    def enter_now(self) -> Dispatch | None:
        """Queue for the slot: the Dispatch if it was free, else None (await `wait`)."""
        return self._scheduler._submit(self._waiter)

    def wait(self) -> Coroutine[None, None, Dispatch]:
        """After `enter_now` gave None: the wait for the slot."""
        return self._scheduler._wait(self._waiter)

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.release()
