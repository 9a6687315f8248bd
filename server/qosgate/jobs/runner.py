"""The batch runner: dispatches pending items through the same path as interactive calls.

Items go through admission, the scheduler (at the `batch` class, so interactive classes
always win the dispatch window) and the upstream like any request; the runner only keeps
a bounded number of them in flight, so the scheduler's queues hold a few batch items
rather than a whole job. Transient failures (shedding, upstream trouble, quota refusals)
are retried with exponential backoff; other errors are recorded as the item's result.

Every item in flight holds a lease in the store, renewed every `lease_renew_interval_s`;
at the same turn the runner re-queues items whose lease ran out (their gateway died) and
stops its own items that it no longer holds or whose job was cancelled on another gateway.
"""

from __future__ import annotations

import asyncio
import logging
import random
from collections.abc import Callable
from dataclasses import dataclass
from typing import Protocol

from qosgate.auth import Tenant
from qosgate.errors import (
    DeadlineExceeded,
    GatewayError,
    Internal,
    PermissionDenied,
    QuotaExceeded,
    Unavailable,
)
from qosgate.jobs.callbacks import CallbackSender
from qosgate.jobs.model import ClaimedItem, ItemError, ItemKind, Job, JobStatus
from qosgate.jobs.store import JobStore

log = logging.getLogger(__name__)

# Errors a later attempt may not hit: the upstream or the gateway was busy or broken.
TRANSIENT_ERRORS: tuple[type[GatewayError], ...] = (Unavailable, DeadlineExceeded, Internal)


class ItemExecutor(Protocol):
    """Runs one item's request for `tenant` at priority class `klass`, within `timeout_s`
    (what is left of its job's completion window), through the edge like any call;
    returns the serialized response or raises a GatewayError."""

    async def execute(
        self, tenant: Tenant, kind: ItemKind, payload: bytes, klass: str, timeout_s: float
    ) -> bytes: ...


@dataclass(frozen=True, slots=True)
class RetryPolicy:
    """How often and how patiently transient failures are retried."""

    max_attempts: int = 5
    base_delay_s: float = 0.5
    max_delay_s: float = 30.0

    def delay_s(self, attempt: int, hint_s: float | None) -> float:
        """Backoff before attempt `attempt + 1`: exponential with jitter, never sooner than
        the server's own retry hint."""
        backoff = min(self.max_delay_s, self.base_delay_s * 2 ** (attempt - 1))
        return max(hint_s or 0.0, backoff * random.uniform(0.5, 1.0))


class JobRunner:
    """Keeps up to `max_in_flight` items dispatched, taking them from tenants in turn."""

    def __init__(
        self,
        store: JobStore,
        executor: ItemExecutor,
        tenant_named: Callable[[str], Tenant | None],
        *,
        wall_time: Callable[[], float],
        callbacks: CallbackSender | None = None,
        klass: str = "batch",
        max_in_flight: int = 8,
        retry: RetryPolicy = RetryPolicy(),
        completion_window_s: float = 86_400.0,
        idle_poll_s: float = 5.0,
        housekeeping_interval_s: float = 60.0,
        lease_renew_interval_s: float = 10.0,
    ) -> None:
        self._store = store
        self._executor = executor
        self._tenant_named = tenant_named
        self._wall_time = wall_time
        self._callbacks = callbacks
        self._klass = klass
        self._max_in_flight = max_in_flight
        self._retry = retry
        self._completion_window_s = completion_window_s
        self._idle_poll_s = idle_poll_s
        self._housekeeping_interval_s = housekeeping_interval_s
        self._lease_renew_interval_s = lease_renew_interval_s
        self._in_flight: dict[asyncio.Task[None], ClaimedItem] = {}
        # Tasks stopped because their item is no longer ours to finish.
        self._revoked: set[asyncio.Task[None]] = set()
        self._callback_tasks: dict[str, asyncio.Task[None]] = {}
        self._wake = asyncio.Event()
        self._last_tenant = ""
        self._recovered = False
        self._next_housekeeping = self._next_lease_turn = 0.0

    def notify(self) -> None:
        """New work exists (a job was sealed): look for it now rather than at the next poll."""
        self._wake.set()

    async def cancel(self, tenant: str, job_id: str) -> Job:
        """Cancel a job: nothing more is dispatched and its in-flight items here are
        stopped (those on other gateways at their runner's next lease renewal)."""
        job = await self._store.cancel_job(tenant, job_id)
        for task, item in list(self._in_flight.items()):
            if item.job_id == job_id:
                task.cancel()
        return job

    async def run(self) -> None:
        """Dispatch until cancelled. Items in flight at shutdown stay `running` in the store
        and are re-run by the next start (or, in a shared store, by another gateway after
        their lease), exactly as after a kill -9."""
        try:
            while True:
                self._wake.clear()
                try:
                    sleep_s = await self._turn()
                except Unavailable as error:
                    log.warning("batch runner: %s; trying again shortly", error.message)
                    sleep_s = self._idle_poll_s
                # asyncio.timeout, not wait_for: on Python 3.11 wait_for can swallow a
                # cancel that lands as the wait ends, and then shutdown never returns.
                try:
                    async with asyncio.timeout(max(0.0, sleep_s)):
                        await self._wake.wait()
                except TimeoutError:
                    pass
        finally:
            tasks = [*self._in_flight, *self._callback_tasks.values()]
            for task in tasks:
                task.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)

    async def _turn(self) -> float:
        """Recovery (once), housekeeping and leases when due, then dispatch; returns how
        long to wait before the next turn unless woken."""
        if not self._recovered:
            requeued = await self._store.recover()
            self._recovered = True
            if requeued:
                log.info("batch runner: %d item(s) re-queued after restart", requeued)
        if self._wall_time() >= self._next_housekeeping:
            # Also retries callbacks that failed (or were cut off by a restart).
            for job in await self._store.callbacks_due(self._housekeeping_interval_s):
                self._send_callback(job)
            await self._store.expire()
            self._next_housekeeping = self._wall_time() + self._housekeeping_interval_s
        if self._wall_time() >= self._next_lease_turn:
            await self._keep_leases()
            self._next_lease_turn = self._wall_time() + self._lease_renew_interval_s
        await self._fill()
        return min(await self._sleep_s(), self._next_lease_turn - self._wall_time())

    async def _keep_leases(self) -> None:
        stop = {item.lease_token for item in await self._store.renew(list(self._in_flight.values()))}
        for task, item in list(self._in_flight.items()):
            if item.lease_token in stop:
                self._revoked.add(task)
                task.cancel()
        requeued = await self._store.requeue_expired()
        if requeued:
            log.info("batch runner: %d item(s) whose lease ran out re-queued", requeued)

    async def _sleep_s(self) -> float:
        if len(self._in_flight) >= self._max_in_flight:
            return self._idle_poll_s  # a finishing item wakes the loop
        retry_at = await self._store.next_retry_at()
        if retry_at is None:
            return self._idle_poll_s
        return min(self._idle_poll_s, max(0.0, retry_at - self._wall_time()))

    async def _fill(self) -> None:
        while len(self._in_flight) < self._max_in_flight:
            work = await self._store.work_by_tenant()
            if not work:
                return
            claimed = False
            # One item per tenant per pass, tenants in turn from the one after the last
            # served, so a tenant with a huge job (or many jobs) does not hold back the
            # others; within a tenant, its oldest job first.
            tenants = sorted(work)
            start = next((i for i, t in enumerate(tenants) if t > self._last_tenant), 0)
            for tenant in tenants[start:] + tenants[:start]:
                if len(self._in_flight) >= self._max_in_flight:
                    break
                item = None
                for job_id in work[tenant]:
                    item = await self._store.claim(job_id)
                    if item is not None:
                        break
                if item is None:
                    continue
                claimed = True
                self._last_tenant = tenant
                task = asyncio.create_task(
                    self._run_item(item), name=f"batch item {item.custom_id}"
                )
                self._in_flight[task] = item
            if not claimed:
                return

    async def _run_item(self, item: ClaimedItem) -> None:
        finished: Job | None = None
        task = asyncio.current_task()
        try:
            finished = await self._attempt(item)
        except Unavailable as error:
            # The store did not take the outcome: the item keeps its lease until it runs
            # out, then runs again (here or on another gateway).
            log.warning("batch item %s of %s: %s", item.custom_id, item.job_id, error.message)
        finally:
            self._in_flight.pop(task, None)  # type: ignore[arg-type]
            self._revoked.discard(task)
            self._wake.set()
        if finished is not None:
            log.info("batch %s %s: %s", finished.id, finished.status.value, finished.counts)
            if finished.callback_url and self._callbacks is not None:
                self._send_callback(finished)

    async def _attempt(self, item: ClaimedItem) -> Job | None:
        tenant = self._tenant_named(item.tenant)
        try:
            if tenant is None:
                raise PermissionDenied(f"tenant {item.tenant!r} no longer exists")
            left_s = self._window_left_s(item)
            if left_s <= 0:
                raise DeadlineExceeded(f"the job's completion window of {self._completion_window_s / 3600:g} h has passed")
            result = await self._executor.execute(tenant, item.kind, item.payload, self._klass, left_s)
        except asyncio.CancelledError:
            if await self._store.job_status(item.job_id) is JobStatus.CANCELLING:
                return await self._store.abandon(item)
            if asyncio.current_task() in self._revoked:
                return None  # another gateway took the item over
            raise  # shutdown: the item stays running and is re-run after restart
        except GatewayError as error:
            return await self._after_error(item, error)
        except Exception:
            log.exception("batch item %s of %s failed unexpectedly", item.custom_id, item.job_id)
            return await self._after_error(item, Internal("internal error"))
        return await self._store.succeed(item, result)

    async def _after_error(self, item: ClaimedItem, error: GatewayError) -> Job | None:
        if isinstance(error, QuotaExceeded):
            # The tenant's own limits (its interactive traffic, its daily budget) hold the
            # job back: wait as told, for as long as it takes, without using up attempts.
            return await self._store.retry_later(
                item, self._wall_time() + error.retry_after_s, count_attempt=False
            )
        transient = isinstance(error, TRANSIENT_ERRORS) and self._window_left_s(item) > 0
        if transient and item.attempt < self._retry.max_attempts:
            hint = getattr(error, "retry_after_s", None)
            delay = self._retry.delay_s(item.attempt, hint)
            return await self._store.retry_later(item, self._wall_time() + delay)
        return await self._store.fail(item, ItemError(type(error).__name__, error.message))

    def _window_left_s(self, item: ClaimedItem) -> float:
        """Seconds left of the item's job's completion window."""
        return item.job_created_at + self._completion_window_s - self._wall_time()

    def _send_callback(self, job: Job) -> None:
        if self._callbacks is None or job.id in self._callback_tasks:
            return
        sender = self._callbacks

        async def deliver() -> None:
            try:
                if await sender.send(job):
                    await self._store.callback_made(job.id)
            except Unavailable as error:
                log.warning("batch %s callback not recorded: %s", job.id, error.message)
            finally:
                del self._callback_tasks[job.id]

        self._callback_tasks[job.id] = asyncio.create_task(
            deliver(), name=f"batch callback {job.id}"
        )
