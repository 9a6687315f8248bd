"""JobRunner with an in-process fake executor: bounded dispatch, retries of transient
errors, permanent failures recorded, cancel stopping in-flight items, restart re-running
what was in flight, callbacks made once; two runners on one store: a cancel on one stops
the other's items, and a stopped runner's items are taken over after their lease."""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path

from qosgate.auth import Tenant
from qosgate.errors import InvalidArgument, QuotaExceeded, Unavailable
from qosgate.jobs.model import ItemKind, Job, JobLimits, JobStatus, NewItem
from qosgate.jobs.runner import JobRunner, RetryPolicy
from qosgate.jobs.postgres_store import PostgresJobStore
from qosgate.jobs.sqlite_store import SqliteJobStore
from qosgate.jobs.store import JobStore

from tests.fakes import make_tenant, until
from tests.postgres_server import PostgresServer

LIMITS = JobLimits(max_queued_items=1000, retention_s=3600.0)
FAST_RETRY = RetryPolicy(max_attempts=3, base_delay_s=0.01, max_delay_s=0.02)
TENANTS = {name: make_tenant(name) for name in ("a", "b")}


class ScriptedExecutor:
    """Answers `payload.upper()`; payloads starting with a scripted prefix misbehave.
    `delay_s` paces calls so that they overlap; `hold`: every call waits until it is
    cancelled (an item that never ends by itself)."""

    def __init__(self, delay_s: float = 0.0, *, hold: bool = False) -> None:
        self.delay_s = delay_s
        self.hold = hold
        self.calls: list[tuple[bytes, str]] = []
        self.timeouts: list[float] = []  # what was left of the job's completion window
        self.cancelled = 0
        self.in_flight = 0
        self.max_in_flight = 0
        # How many more times the payloads "flaky" and "quota" are refused.
        self.refusals_left = {b"flaky": 2, b"quota": 2}

    async def execute(self, tenant: Tenant, kind: ItemKind, payload: bytes, klass: str, timeout_s: float) -> bytes:
        self.calls.append((payload, klass))
        self.timeouts.append(timeout_s)
        self.in_flight += 1
        self.max_in_flight = max(self.max_in_flight, self.in_flight)
        try:
            if self.hold:
                try:
                    await asyncio.Event().wait()
                except asyncio.CancelledError:
                    self.cancelled += 1
                    raise
            await asyncio.sleep(self.delay_s)
            if payload == b"flaky" and self.refusals_left[payload] > 0:
                self.refusals_left[payload] -= 1
                raise Unavailable("shed", retry_after_s=0.01)
            if payload.startswith(b"down"):
                raise Unavailable("upstream down")
            if payload.startswith(b"bad"):
                raise InvalidArgument("no such model")
            if payload == b"quota" and self.refusals_left[payload] > 0:
                self.refusals_left[payload] -= 1
                raise QuotaExceeded("tokens", retry_after_s=0.01, violations=())
            return payload.upper()
        finally:
            self.in_flight -= 1


class RecordingCallbacks:
    """Accepts every callback after refusing the first `failures`."""

    def __init__(self, failures: int = 0) -> None:
        self.sent: list[Job] = []
        self.failures = failures

    async def send(self, job: Job) -> bool:
        self.sent.append(job)
        if self.failures:
            self.failures -= 1
            return False
        return True


async def submit(
    store: JobStore, payloads: list[bytes], callback_url: str = "", tenant: str = "a"
) -> str:
    job_id = await store.begin_job(
        tenant, model="m", description="", callback_url=callback_url, limits=LIMITS
    )
    await store.add_items(
        job_id,
        [NewItem(f"id{n}", ItemKind.GENERATE, p) for n, p in enumerate(payloads)],
        limits=LIMITS,
    )
    await store.seal_job(job_id)
    return job_id


@asynccontextmanager
async def running(runner: JobRunner) -> AsyncIterator[asyncio.Task[None]]:
    task = asyncio.create_task(runner.run())
    try:
        yield task
    finally:
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)


async def until_finished(store: JobStore, job_id: str) -> Job:
    async def finished() -> bool:
        return (await store.get_job("a", job_id)).status.finished

    await until(finished)
    return await store.get_job("a", job_id)


def runner_on(store: JobStore, executor: ScriptedExecutor, **kwargs: object) -> JobRunner:
    return JobRunner(
        store,
        executor,
        TENANTS.get,
        wall_time=time.time,
        retry=FAST_RETRY,
        idle_poll_s=0.05,
        **kwargs,  # type: ignore[arg-type]
    )


def make(
    tmp_path: Path, executor: ScriptedExecutor, *, lease_s: float = 30.0, **kwargs: object
) -> tuple[JobStore, JobRunner]:
    store = SqliteJobStore(tmp_path / "jobs.db", wall_time=time.time, lease_s=lease_s)
    return store, runner_on(store, executor, **kwargs)


async def test_items_run_at_batch_class_within_the_in_flight_bound(tmp_path: Path) -> None:
    executor = ScriptedExecutor(delay_s=0.01)
    store, runner = make(tmp_path, executor, max_in_flight=3)
    job_id = await submit(store, [f"p{n}".encode() for n in range(20)])
    async with running(runner):
        runner.notify()
        job = await until_finished(store, job_id)
    assert job.status is JobStatus.COMPLETED and job.counts.succeeded == 20
    assert executor.max_in_flight == 3
    assert {klass for _, klass in executor.calls} == {"batch"}
    results = await store.results("a", job_id, offset=0, limit=100)
    assert sorted(r.custom_id for r in results) == sorted(f"id{n}" for n in range(20))
    assert {r.payload for r in results} == {f"P{n}".encode() for n in range(20)}


async def test_items_have_what_is_left_of_their_jobs_completion_window(tmp_path: Path) -> None:
    executor = ScriptedExecutor()
    store, runner = make(tmp_path, executor, completion_window_s=3600.0)
    job_id = await submit(store, [b"p0", b"p1"])
    async with running(runner):
        await until_finished(store, job_id)
    assert all(3500 < left <= 3600 for left in executor.timeouts), executor.timeouts


async def test_an_item_past_its_jobs_completion_window_fails_for_good_unrun(tmp_path: Path) -> None:
    executor = ScriptedExecutor()
    store, runner = make(tmp_path, executor, completion_window_s=1e-6)
    job_id = await submit(store, [b"p0"])
    async with running(runner):
        job = await until_finished(store, job_id)
    assert job.counts.failed == 1 and executor.calls == []
    (result,) = await store.results("a", job_id, offset=0, limit=10)
    assert result.error is not None and result.error.kind == "DeadlineExceeded"
    assert "completion window" in result.error.message and result.attempts == 1


async def test_tenants_take_turns_whatever_their_jobs(tmp_path: Path) -> None:
    executor = ScriptedExecutor(delay_s=0.005)
    store, runner = make(tmp_path, executor, max_in_flight=2)
    # Tenant a queued three jobs first; b's one job must not get only a quarter of turns.
    bigs = [await submit(store, [f"a{j}{n}".encode() for n in range(10)], tenant="a") for j in range(3)]
    small = await submit(store, [f"b{n}".encode() for n in range(5)], tenant="b")
    async with running(runner):
        for job_id in bigs:
            await until_finished(store, job_id)
    order = [payload.decode()[0] for payload, _ in executor.calls]
    assert order[:10].count("b") == 5, order
    assert (await store.get_job("b", small)).status is JobStatus.COMPLETED


async def test_transient_errors_retry_and_permanent_ones_are_recorded(tmp_path: Path) -> None:
    executor = ScriptedExecutor()
    store, runner = make(tmp_path, executor)
    job_id = await submit(store, [b"flaky", b"bad", b"down", b"quota"])
    async with running(runner):
        job = await until_finished(store, job_id)
    by_id = {r.custom_id: r for r in await store.results("a", job_id, offset=0, limit=10)}
    assert by_id["id0"].payload == b"FLAKY" and by_id["id0"].attempts == 3
    assert by_id["id1"].error is not None and by_id["id1"].error.kind == "InvalidArgument"
    assert by_id["id1"].attempts == 1  # permanent: not retried
    assert by_id["id2"].error is not None and by_id["id2"].error.kind == "Unavailable"
    assert by_id["id2"].attempts == FAST_RETRY.max_attempts
    assert job.counts.succeeded == 2 and job.counts.failed == 2


async def test_quota_refusals_wait_without_using_attempts(tmp_path: Path) -> None:
    executor = ScriptedExecutor()
    executor.refusals_left[b"quota"] = 10  # more refusals than max_attempts
    store, runner = make(tmp_path, executor)
    job_id = await submit(store, [b"quota"])
    async with running(runner):
        await until_finished(store, job_id)
    (result,) = await store.results("a", job_id, offset=0, limit=10)
    assert result.payload == b"QUOTA" and result.attempts == 1


async def test_cancel_stops_in_flight_items_quickly(tmp_path: Path) -> None:
    executor = ScriptedExecutor(hold=True)
    store, runner = make(tmp_path, executor, max_in_flight=2)
    job_id = await submit(store, [f"p{n}".encode() for n in range(10)])
    async with running(runner):
        await until(lambda: executor.in_flight >= 2)
        await runner.cancel("a", job_id)
        job = await until_finished(store, job_id)
        # Stopped by the cancel itself (the items never end on their own).
        assert executor.cancelled == 2
    assert job.status is JobStatus.CANCELLED and job.counts.cancelled == 10
    assert len(executor.calls) == 2


async def test_restart_reruns_items_that_were_in_flight(tmp_path: Path) -> None:
    slow = ScriptedExecutor(hold=True)
    store, runner = make(tmp_path, slow, max_in_flight=2)
    job_id = await submit(store, [f"p{n}".encode() for n in range(4)])
    async with running(runner):
        await until(lambda: slow.in_flight >= 2)
    # Shutdown mid-item behaves like a crash: the two items stay running in the store.
    assert (await store.get_job("a", job_id)).counts.running == 2
    fast = ScriptedExecutor()
    store2, runner2 = make(tmp_path, fast)
    async with running(runner2):
        job = await until_finished(store2, job_id)
    assert job.counts.succeeded == 4
    results = await store2.results("a", job_id, offset=0, limit=10)
    assert sorted(r.custom_id for r in results) == ["id0", "id1", "id2", "id3"]


async def test_callback_is_made_once_when_the_job_ends(tmp_path: Path) -> None:
    callbacks = RecordingCallbacks()
    store, runner = make(tmp_path, ScriptedExecutor(), callbacks=callbacks)
    job_id = await submit(store, [b"x"], callback_url="http://hooks.local/done")
    async with running(runner):
        await until_finished(store, job_id)
        await until(lambda: bool(callbacks.sent))
    assert [j.id for j in callbacks.sent] == [job_id]
    assert await store.callbacks_due(hold_s=0) == []


async def test_failed_callback_is_retried_at_housekeeping(tmp_path: Path) -> None:
    callbacks = RecordingCallbacks(failures=1)
    # The finishing runner holds the callback for the lease; housekeeping retries after.
    store, runner = make(
        tmp_path,
        ScriptedExecutor(),
        lease_s=0.1,
        callbacks=callbacks,
        housekeeping_interval_s=0.05,
    )
    job_id = await submit(store, [b"x"], callback_url="http://hooks.local/done")
    async with running(runner):
        await until_finished(store, job_id)
        await until(lambda: len(callbacks.sent) >= 2)
    assert [j.id for j in callbacks.sent] == [job_id, job_id]
    assert await store.callbacks_due(hold_s=0) == []


async def test_a_cancel_on_another_gateway_stops_this_ones_items(tmp_path: Path) -> None:
    slow = ScriptedExecutor(hold=True)
    store, runner = make(tmp_path, slow, max_in_flight=2, lease_renew_interval_s=0.05)
    other = SqliteJobStore(tmp_path / "jobs.db", wall_time=time.time, owner="gw-other")
    job_id = await submit(store, [f"p{n}".encode() for n in range(10)])
    async with running(runner):
        await until(lambda: slow.in_flight >= 2)
        await other.cancel_job("a", job_id)
        # The runner learns of it when it renews its leases, not from a call of its own.
        job = await until_finished(store, job_id)
    assert job.status is JobStatus.CANCELLED and job.counts.cancelled == 10
    assert len(slow.calls) == 2
    await other.close()


async def test_a_stopped_gateways_items_are_finished_by_another_after_the_lease(
    postgres: PostgresServer,
) -> None:
    url = postgres.database()
    lease_s = 0.5

    def gateway(owner: str, executor: ScriptedExecutor, **kwargs: object) -> tuple[JobStore, JobRunner]:
        store = PostgresJobStore(url, wall_time=time.time, lease_s=lease_s, owner=owner)
        return store, runner_on(store, executor, lease_renew_interval_s=lease_s / 5, **kwargs)

    stuck = ScriptedExecutor(hold=True)
    dead_store, dead = gateway("gw-dead", stuck, max_in_flight=2)
    fast = ScriptedExecutor()
    store, alive = gateway("gw-alive", fast)
    await dead_store.open()
    await store.open()
    job_id = await submit(store, [f"p{n}".encode() for n in range(6)])
    async with running(dead):
        await until(lambda: stuck.in_flight >= 2)
    # gw-dead stopped mid-item, as in a kill -9: its two items keep leases nobody renews.
    async with running(alive):
        job = await until_finished(store, job_id)
    assert job.status is JobStatus.COMPLETED and job.counts.succeeded == 6
    results = await store.results("a", job_id, offset=0, limit=10)
    assert sorted(r.custom_id for r in results) == [f"id{n}" for n in range(6)]
    taken_over = {payload.decode() for payload, _ in stuck.calls}
    assert len(taken_over) == 2
    assert all(r.attempts >= 2 for r in results if r.payload.decode().lower() in taken_over)
    await dead_store.close()
    await store.close()
