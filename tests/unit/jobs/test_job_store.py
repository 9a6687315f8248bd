"""JobStore: all-or-nothing uploads, tenant isolation, exactly one result per custom_id
across a simulated kill -9 (a second store opened on the same file), cancel, retention."""

from __future__ import annotations

from pathlib import Path

import pytest
from qosgate.errors import InvalidArgument, NotFound, QuotaExceeded
from qosgate.jobs.model import ItemError, ItemKind, JobLimits, JobStatus, NewItem
from qosgate.jobs.store import JobStore

LIMITS = JobLimits(max_queued_items=100, retention_s=3600.0)


class WallClock:
    def __init__(self) -> None:
        self.t = 1_700_000_000.0

    def __call__(self) -> float:
        return self.t


def items(*ids: str) -> list[NewItem]:
    return [NewItem(i, ItemKind.GENERATE, f"payload {i}".encode()) for i in ids]


def submit(store: JobStore, tenant: str, *ids: str) -> str:
    job_id = store.begin_job(tenant, model="m", description="", callback_url="", limits=LIMITS)
    store.add_items(job_id, items(*ids), limits=LIMITS)
    store.seal_job(job_id)
    return job_id


@pytest.fixture
def clock() -> WallClock:
    return WallClock()


@pytest.fixture
def store(tmp_path: Path, clock: WallClock) -> JobStore:
    return JobStore(tmp_path / "jobs.db", wall_time=clock)


def test_upload_is_invisible_until_sealed_and_discard_leaves_nothing(store: JobStore) -> None:
    job_id = store.begin_job("a", model="m", description="", callback_url="", limits=LIMITS)
    store.add_items(job_id, items("1", "2"), limits=LIMITS)
    with pytest.raises(NotFound):
        store.get_job("a", job_id)
    assert store.work_by_tenant() == {}
    store.discard_job(job_id)
    assert store.list_jobs("a", limit=10) == []


def test_duplicate_custom_id_across_chunks_is_refused(store: JobStore) -> None:
    job_id = store.begin_job("a", model="m", description="", callback_url="", limits=LIMITS)
    store.add_items(job_id, items("1", "2"), limits=LIMITS)
    with pytest.raises(InvalidArgument, match="'2' is used twice"):
        store.add_items(job_id, items("3", "2"), limits=LIMITS)


def test_queued_item_limit_counts_every_job_of_the_tenant(store: JobStore) -> None:
    small = JobLimits(max_queued_items=3, retention_s=60)
    submit(store, "a", "1", "2")
    job_id = store.begin_job("a", model="m", description="", callback_url="", limits=small)
    with pytest.raises(QuotaExceeded) as caught:
        store.add_items(job_id, items("x", "y"), limits=small)
    assert caught.value.violations[0].subject == "tenant:a"
    # Another tenant is not affected.
    other = store.begin_job("b", model="m", description="", callback_url="", limits=small)
    store.add_items(other, items("x", "y", "z"), limits=small)


def test_tenant_sees_only_its_own_jobs(store: JobStore) -> None:
    mine = submit(store, "a", "1")
    with pytest.raises(NotFound):
        store.get_job("b", mine)
    with pytest.raises(NotFound):
        store.results("b", mine, offset=0, limit=10)
    with pytest.raises(NotFound):
        store.cancel_job("b", mine)
    assert store.list_jobs("b", limit=10) == []


def test_list_pages_newest_first(store: JobStore, clock: WallClock) -> None:
    ids = []
    for n in range(5):
        clock.t += 1
        ids.append(submit(store, "a", str(n)))
    first = store.list_jobs("a", limit=2)
    second = store.list_jobs("a", limit=2, after_id=first[-1].id)
    third = store.list_jobs("a", limit=2, after_id=second[-1].id)
    assert [j.id for j in first + second + third] == ids[::-1]


def test_results_in_completion_order_and_job_completes(store: JobStore) -> None:
    job_id = submit(store, "a", "1", "2")
    first = store.claim(job_id)
    second = store.claim(job_id)
    assert first and second and store.claim(job_id) is None
    assert store.get_job("a", job_id).status is JobStatus.RUNNING
    assert store.fail(second, ItemError("InvalidArgument", "bad")) is None
    finished = store.succeed(first, b"result 1")
    assert finished is not None and finished.status is JobStatus.COMPLETED
    assert finished.expires_at == finished.finished_at + LIMITS.retention_s
    results = store.results("a", job_id, offset=0, limit=10)
    assert [(r.offset, r.custom_id) for r in results] == [(0, "2"), (1, "1")]
    assert results[0].error == ItemError("InvalidArgument", "bad")
    assert results[1].payload == b"result 1"
    assert [r.custom_id for r in store.results("a", job_id, offset=1, limit=10)] == ["1"]


def test_kill_and_recover_gives_exactly_one_result_per_item(
    tmp_path: Path, clock: WallClock
) -> None:
    path = tmp_path / "jobs.db"
    before = JobStore(path, wall_time=clock)
    job_id = submit(before, "a", "1", "2", "3")
    done = before.claim(job_id)
    lost = before.claim(job_id)
    assert done and lost
    before.succeed(done, b"r1")
    # The process dies here with item 2 at the model: no close, no cleanup.
    after = JobStore(path, wall_time=clock)
    assert after.recover() == 1
    claimed = [after.claim(job_id), after.claim(job_id)]
    assert sorted(c.custom_id for c in claimed if c) == ["2", "3"]
    assert claimed[0] and claimed[0].attempt == 2  # item 2 runs for the second time
    # A stale completion from the dead process's claim must not add a second result.
    after.succeed(done, b"again")
    for item in claimed:
        assert item is not None
        after.succeed(item, b"r")
    results = after.results("a", job_id, offset=0, limit=10)
    assert sorted(r.custom_id for r in results) == ["1", "2", "3"]
    assert after.get_job("a", job_id).status is JobStatus.COMPLETED


def test_cancel_stops_pending_items_and_waits_for_running_ones(store: JobStore) -> None:
    job_id = submit(store, "a", "1", "2", "3")
    running = store.claim(job_id)
    assert running
    job = store.cancel_job("a", job_id)
    assert job.status is JobStatus.CANCELLING
    assert job.counts.cancelled == 2 and job.counts.running == 1
    assert store.work_by_tenant() == {}
    finished = store.succeed(running, b"r1")
    assert finished is not None and finished.status is JobStatus.CANCELLED
    assert [r.custom_id for r in store.results("a", job_id, offset=0, limit=10)] == ["1"]


def test_retry_later_holds_item_until_backoff_passes(store: JobStore, clock: WallClock) -> None:
    job_id = submit(store, "a", "1")
    item = store.claim(job_id)
    assert item
    store.retry_later(item, clock.t + 5, count_attempt=False)
    assert store.work_by_tenant() == {}
    assert store.next_retry_at() == clock.t + 5
    clock.t += 5
    again = store.claim(job_id)
    assert again and again.attempt == 1


def test_finished_jobs_expire_after_retention(store: JobStore, clock: WallClock) -> None:
    job_id = submit(store, "a", "1")
    item = store.claim(job_id)
    assert item
    store.succeed(item, b"r")
    clock.t += LIMITS.retention_s - 1
    assert store.expire() == 0
    clock.t += 1
    assert store.expire() == 1
    with pytest.raises(NotFound):
        store.get_job("a", job_id)
