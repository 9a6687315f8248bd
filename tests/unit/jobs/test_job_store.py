"""JobStore contract, run against both implementations with the same assertions: the
embedded SQLite file and a real PostgreSQL server.

All-or-nothing uploads, tenant isolation, paging, cancel, retention, and what two
gateways on one store need: a job created on one is read and cancelled on the other,
leases keep an item with its holder and hand it over once they run out (the clock is
injected), and every custom_id ends with exactly one result whatever stale holders write.
"""

from __future__ import annotations

import asyncio
import sqlite3
from collections.abc import AsyncIterator, Awaitable, Callable
from pathlib import Path

import pytest
from conftest import free_port
from qosgate.errors import InvalidArgument, NotFound, QuotaExceeded, Unavailable
from qosgate.jobs.model import ClaimedItem, ItemError, ItemKind, JobLimits, JobStatus, NewItem
from qosgate.jobs.postgres_store import PostgresJobStore
from qosgate.jobs.sqlite_store import SqliteJobStore
from qosgate.jobs.store import UPLOAD_IDLE_S, JobStore, SqlJobStore

from tests.fakes import FakeWall
from tests.postgres_server import PostgresServer

pytestmark = pytest.mark.asyncio(loop_scope="session")

LIMITS = JobLimits(max_queued_items=100, retention_s=3600.0)
LEASE_S = 30.0



# Opens one more store on the test's database: another gateway (its own connections,
# its own lease owner) sharing the same jobs.
Gateways = Callable[[str], Awaitable[SqlJobStore]]


def items(*ids: str) -> list[NewItem]:
    return [NewItem(i, ItemKind.GENERATE, f"payload {i}".encode()) for i in ids]


async def submit(store: JobStore, tenant: str, *ids: str) -> str:
    job_id = await store.begin_job(tenant, model="m", description="", callback_url="", limits=LIMITS)
    await store.add_items(job_id, items(*ids), limits=LIMITS)
    await store.seal_job(job_id)
    return job_id


async def claim(store: JobStore, job_id: str) -> ClaimedItem:
    item = await store.claim(job_id)
    assert item is not None
    return item


@pytest.fixture
def clock() -> FakeWall:
    return FakeWall(1_700_000_000.0)


@pytest.fixture(params=["sqlite", "postgres"])
async def gateways(
    request: pytest.FixtureRequest, tmp_path: Path, clock: FakeWall
) -> AsyncIterator[Gateways]:
    opened: list[SqlJobStore] = []
    if request.param == "postgres":
        server: PostgresServer = request.getfixturevalue("postgres")
        url = server.database()

    async def open_store(owner: str) -> SqlJobStore:
        store: SqlJobStore
        if request.param == "postgres":
            store = PostgresJobStore(url, wall_time=clock, lease_s=LEASE_S, owner=owner)
        else:
            store = SqliteJobStore(tmp_path / "jobs.db", wall_time=clock, lease_s=LEASE_S, owner=owner)
        await store.open()
        opened.append(store)
        return store

    yield open_store
    for store in opened:
        await store.close()


@pytest.fixture
async def store(gateways: Gateways) -> SqlJobStore:
    return await gateways("gw-a")


async def test_upload_is_invisible_until_sealed_and_discard_leaves_nothing(store: JobStore) -> None:
    job_id = await store.begin_job("a", model="m", description="", callback_url="", limits=LIMITS)
    await store.add_items(job_id, items("1", "2"), limits=LIMITS)
    with pytest.raises(NotFound):
        await store.get_job("a", job_id)
    assert await store.work_by_tenant() == {}
    await store.discard_job(job_id)
    assert await store.list_jobs("a", limit=10) == []


async def test_an_idle_upload_expires(store: JobStore, clock: FakeWall) -> None:
    job_id = await store.begin_job("a", model="m", description="", callback_url="", limits=LIMITS)
    await store.add_items(job_id, items("1"), limits=LIMITS)
    clock.now += UPLOAD_IDLE_S - 1
    await store.add_items(job_id, items("2"), limits=LIMITS)  # each chunk keeps it alive
    clock.now += UPLOAD_IDLE_S - 1
    assert await store.expire() == 0
    clock.now += 1
    assert await store.expire() == 1
    with pytest.raises(NotFound, match="no upload in progress"):
        await store.add_items(job_id, items("3"), limits=LIMITS)


async def test_duplicate_custom_id_within_and_across_chunks_is_refused(store: JobStore) -> None:
    job_id = await store.begin_job("a", model="m", description="", callback_url="", limits=LIMITS)
    await store.add_items(job_id, items("1", "2"), limits=LIMITS)
    with pytest.raises(InvalidArgument, match="item 3: custom_id '2' is used twice"):
        await store.add_items(job_id, items("3", "2"), limits=LIMITS)
    with pytest.raises(InvalidArgument, match="item 3: custom_id '4' is used twice"):
        await store.add_items(job_id, items("4", "4"), limits=LIMITS)
    with pytest.raises(InvalidArgument, match="item 2: custom_id is empty"):
        await store.add_items(job_id, items(""), limits=LIMITS)
    # The refused chunks added nothing.
    assert (await store.seal_job(job_id)).counts.total == 2


async def test_queued_item_limit_counts_every_job_of_the_tenant(store: JobStore) -> None:
    small = JobLimits(max_queued_items=3, retention_s=60)
    await submit(store, "a", "1", "2")
    job_id = await store.begin_job("a", model="m", description="", callback_url="", limits=small)
    with pytest.raises(QuotaExceeded) as caught:
        await store.add_items(job_id, items("x", "y"), limits=small)
    assert caught.value.violations[0].subject == "tenant:a"
    # Another tenant is not affected.
    other = await store.begin_job("b", model="m", description="", callback_url="", limits=small)
    await store.add_items(other, items("x", "y", "z"), limits=small)


async def test_tenant_sees_only_its_own_jobs(store: JobStore) -> None:
    mine = await submit(store, "a", "1")
    with pytest.raises(NotFound):
        await store.get_job("b", mine)
    with pytest.raises(NotFound):
        await store.results("b", mine, offset=0, limit=10)
    with pytest.raises(NotFound):
        await store.cancel_job("b", mine)
    assert await store.list_jobs("b", limit=10) == []


async def test_list_pages_newest_first(store: JobStore, clock: FakeWall) -> None:
    ids = []
    for n in range(5):
        clock.now += 1
        ids.append(await submit(store, "a", str(n)))
    first = await store.list_jobs("a", limit=2)
    second = await store.list_jobs("a", limit=2, after_id=first[-1].id)
    third = await store.list_jobs("a", limit=2, after_id=second[-1].id)
    assert [j.id for j in first + second + third] == ids[::-1]
    with pytest.raises(InvalidArgument):
        await store.list_jobs("b", limit=2, after_id=ids[0])


async def test_results_in_completion_order_and_job_completes(store: JobStore) -> None:
    job_id = await submit(store, "a", "1", "2")
    first = await claim(store, job_id)
    second = await claim(store, job_id)
    assert await store.claim(job_id) is None
    assert (await store.get_job("a", job_id)).status is JobStatus.RUNNING
    assert await store.fail(second, ItemError("InvalidArgument", "bad")) is None
    finished = await store.succeed(first, b"result 1")
    assert finished is not None and finished.status is JobStatus.COMPLETED
    assert finished.finished_at is not None
    assert finished.expires_at == finished.finished_at + LIMITS.retention_s
    results = await store.results("a", job_id, offset=0, limit=10)
    assert [(r.offset, r.custom_id) for r in results] == [(0, "2"), (1, "1")]
    assert results[0].error == ItemError("InvalidArgument", "bad")
    assert results[1].payload == b"result 1"
    assert [r.custom_id for r in await store.results("a", job_id, offset=1, limit=10)] == ["1"]


async def test_cancel_stops_pending_items_and_waits_for_running_ones(store: JobStore) -> None:
    job_id = await submit(store, "a", "1", "2", "3")
    running = await claim(store, job_id)
    job = await store.cancel_job("a", job_id)
    assert job.status is JobStatus.CANCELLING
    assert job.counts.cancelled == 2 and job.counts.running == 1
    assert await store.work_by_tenant() == {}
    finished = await store.succeed(running, b"r1")
    assert finished is not None and finished.status is JobStatus.CANCELLED
    assert [r.custom_id for r in await store.results("a", job_id, offset=0, limit=10)] == ["1"]


async def test_retry_later_holds_item_until_backoff_passes(store: JobStore, clock: FakeWall) -> None:
    job_id = await submit(store, "a", "1")
    item = await claim(store, job_id)
    await store.retry_later(item, clock.now + 5, count_attempt=False)
    assert await store.work_by_tenant() == {}
    assert await store.next_retry_at() == clock.now + 5
    clock.now += 5
    again = await claim(store, job_id)
    assert again.attempt == 1


async def test_finished_jobs_expire_after_retention(store: JobStore, clock: FakeWall) -> None:
    job_id = await submit(store, "a", "1")
    await store.succeed(await claim(store, job_id), b"r")
    clock.now += LIMITS.retention_s - 1
    assert await store.expire() == 0
    clock.now += 1
    assert await store.expire() == 1
    with pytest.raises(NotFound):
        await store.get_job("a", job_id)


async def test_one_gateway_at_a_time_sends_a_due_callback_until_it_is_made(
    gateways: Gateways, clock: FakeWall
) -> None:
    finisher, other = await gateways("gw-a"), await gateways("gw-b")
    job_id = await finisher.begin_job(
        "a", model="m", description="d", callback_url="http://h/x", limits=LIMITS
    )
    await finisher.add_items(job_id, items("1"), limits=LIMITS)
    await finisher.seal_job(job_id)
    assert await other.callbacks_due(hold_s=60) == []
    finished = await finisher.succeed(await claim(finisher, job_id), b"r")
    assert finished is not None  # the finisher sends the callback now, alone
    assert await other.callbacks_due(hold_s=60) == []
    clock.now += LEASE_S  # ... and it failed, or the finisher died: anyone may retry
    assert [j.id for j in await other.callbacks_due(hold_s=60)] == [job_id]
    assert await finisher.callbacks_due(hold_s=60) == []  # reserved to the other one
    clock.now += 60
    assert [j.id for j in await finisher.callbacks_due(hold_s=60)] == [job_id]
    await finisher.callback_made(job_id)
    clock.now += 60
    assert await other.callbacks_due(hold_s=60) == []


# -- two gateways on one store --------------------------------------------------------


async def test_a_job_created_on_one_gateway_is_served_by_another(gateways: Gateways) -> None:
    one, other = await gateways("gw-a"), await gateways("gw-b")
    job_id = await submit(one, "a", "1", "2", "3")
    assert (await other.get_job("a", job_id)).counts.total == 3
    assert [j.id for j in await other.list_jobs("a", limit=10)] == [job_id]
    await other.succeed(await claim(other, job_id), b"r1")
    assert [r.custom_id for r in await one.results("a", job_id, offset=0, limit=10)] == ["1"]
    running = await claim(one, job_id)
    cancelled = await other.cancel_job("a", job_id)
    assert cancelled.status is JobStatus.CANCELLING and cancelled.counts.cancelled == 1
    # The holder learns of the cancel when it renews: the lease is not extended.
    assert await one.renew([running]) == [running]
    finished = await one.abandon(running)
    assert finished is not None and finished.status is JobStatus.CANCELLED
    assert finished.counts.succeeded == 1 and finished.counts.cancelled == 2


async def test_a_dead_gateways_items_are_taken_over_after_the_lease(
    gateways: Gateways, clock: FakeWall
) -> None:
    dead, alive = await gateways("gw-dead"), await gateways("gw-alive")
    job_id = await submit(dead, "a", "1", "2", "3")
    done = await claim(dead, job_id)
    lost = await claim(dead, job_id)
    await dead.succeed(done, b"r1")
    # gw-dead stops here (kill -9): item 2 holds its lease and nobody renews it.
    clock.now += LEASE_S - 1
    assert await alive.requeue_expired() == 0
    remaining = await claim(alive, job_id)
    assert remaining.custom_id == "3" and await alive.claim(job_id) is None
    clock.now += 1
    assert await alive.requeue_expired() == 1
    taken = await claim(alive, job_id)
    assert (taken.custom_id, taken.attempt) == ("2", 2)  # item 2 runs for the second time
    # A stale completion from the dead gateway's claim adds no second result.
    assert await dead.succeed(lost, b"stale") is None
    await alive.succeed(remaining, b"r3")
    finished = await alive.succeed(taken, b"r2")
    assert finished is not None and finished.status is JobStatus.COMPLETED
    results = await alive.results("a", job_id, offset=0, limit=10)
    assert sorted((r.custom_id, r.payload) for r in results) == [
        ("1", b"r1"),
        ("2", b"r2"),
        ("3", b"r3"),
    ]
    assert [r.offset for r in results] == [0, 1, 2]


async def test_renewed_leases_hold_and_lost_ones_are_reported(
    gateways: Gateways, clock: FakeWall
) -> None:
    holder, other = await gateways("gw-a"), await gateways("gw-b")
    job_id = await submit(holder, "a", "1", "2")
    first, second = await claim(holder, job_id), await claim(holder, job_id)
    for _ in range(3):
        clock.now += LEASE_S * 0.9
        assert await holder.renew([first, second]) == []
        assert await other.requeue_expired() == 0
    clock.now += LEASE_S
    assert await other.requeue_expired() == 2
    assert await holder.renew([first, second]) == [first, second]
    # Nor does a lost lease come back by finishing: the item is someone else's now.
    assert await holder.retry_later(first, clock.now) is None
    assert (await other.get_job("a", job_id)).counts.pending == 2


async def test_expired_items_of_a_cancelled_job_end_cancelled(
    gateways: Gateways, clock: FakeWall
) -> None:
    dead, alive = await gateways("gw-dead"), await gateways("gw-alive")
    job_id = await submit(dead, "a", "1", "2")
    await claim(dead, job_id)
    await alive.cancel_job("a", job_id)
    clock.now += LEASE_S
    assert await alive.requeue_expired() == 1
    job = await alive.get_job("a", job_id)
    assert job.status is JobStatus.CANCELLED and job.counts.cancelled == 2


async def test_concurrent_claims_and_finishes_give_each_item_once(gateways: Gateways) -> None:
    stores = [await gateways(f"gw-{n}") for n in range(4)]
    job_id = await submit(stores[0], "a", *(str(n) for n in range(24)))

    async def drain(store: SqlJobStore) -> list[str]:
        taken = []
        while (item := await store.claim(job_id)) is not None:
            taken.append(item.custom_id)
            await store.succeed(item, item.custom_id.encode())
        return taken

    per_gateway = await asyncio.gather(*(drain(s) for s in stores))
    claimed = [custom_id for taken in per_gateway for custom_id in taken]
    assert sorted(claimed) == sorted(str(n) for n in range(24))
    job = await stores[1].get_job("a", job_id)
    assert job.status is JobStatus.COMPLETED and job.counts.succeeded == 24
    results = await stores[2].results("a", job_id, offset=0, limit=100)
    assert [r.offset for r in results] == list(range(24))
    assert sorted(r.custom_id for r in results) == sorted(claimed)


# -- what differs: who may release a lease at start ------------------------------------


async def test_start_releases_only_what_no_live_gateway_can_hold(gateways: Gateways) -> None:
    before = await gateways("gw-before")
    job_id = await submit(before, "a", "1", "2")
    await claim(before, job_id)
    after = await gateways("gw-after")
    released = await after.recover()
    if isinstance(after, SqliteJobStore):
        # The file is one gateway's: a running item is its previous run's, dead now.
        assert released == 1
        assert (await claim(after, job_id)).attempt == 2
    else:
        # Shared: gw-before may be alive, its item stays its own until the lease ends.
        assert released == 0
        assert (await claim(after, job_id)).custom_id == "2"
        assert await after.claim(job_id) is None


async def test_sqlite_file_from_before_leases_is_upgraded(tmp_path: Path, clock: FakeWall) -> None:
    path = tmp_path / "old.db"
    old = sqlite3.connect(path)
    old.executescript(
        """
        CREATE TABLE batch_jobs (id TEXT PRIMARY KEY, tenant TEXT NOT NULL, status TEXT NOT NULL,
            model TEXT NOT NULL, description TEXT NOT NULL, callback_url TEXT NOT NULL,
            callback_pending INTEGER NOT NULL DEFAULT 0, retention_s REAL NOT NULL,
            created_at REAL NOT NULL, started_at REAL, finished_at REAL, expires_at REAL);
        CREATE TABLE batch_items (job_id TEXT NOT NULL REFERENCES batch_jobs (id) ON DELETE CASCADE,
            seq INTEGER NOT NULL, custom_id TEXT NOT NULL, kind TEXT NOT NULL, payload BLOB NOT NULL,
            state TEXT NOT NULL, attempts INTEGER NOT NULL DEFAULT 0,
            not_before REAL NOT NULL DEFAULT 0, PRIMARY KEY (job_id, seq), UNIQUE (job_id, custom_id));
        INSERT INTO batch_jobs VALUES ('batch_old', 'a', 'running', 'm', '', '', 0, 60, 1, 1, NULL, NULL);
        INSERT INTO batch_items VALUES ('batch_old', 0, 'x', 'generate', X'00', 'running', 1, 0);
        """
    )
    old.close()
    store = SqliteJobStore(path, wall_time=clock)
    assert await store.recover() == 1
    item = await claim(store, "batch_old")
    finished = await store.succeed(item, b"r")
    assert finished is not None and finished.counts.succeeded == 1
    await store.close()


async def test_postgres_out_of_reach_fails_calls_unavailable_until_it_answers(
    clock: FakeWall,
) -> None:
    server = PostgresServer(free_port())
    store = PostgresJobStore(server.url(), wall_time=clock, timeout_s=0.5)
    await store.open()  # logs, does not raise: a gateway serves interactive calls without it
    with pytest.raises(Unavailable):
        await store.work_by_tenant()
    server.start()
    try:
        deadline = asyncio.get_running_loop().time() + 30
        while True:
            try:
                job_id = await submit(store, "a", "1")
                break
            except Unavailable:
                assert asyncio.get_running_loop().time() < deadline, "never reconnected"
                await asyncio.sleep(0.2)
        assert (await store.get_job("a", job_id)).counts.total == 1
    finally:
        server.stop()
    with pytest.raises(Unavailable):
        await store.get_job("a", job_id)
    await store.close()
