"""Batch job storage: the `JobStore` role, and the SQL its two implementations share.

`SqliteJobStore` (embedded, one gateway per file) and `PostgresJobStore` (shared by every
gateway that names the same database) run the same statements; they differ only in how a
transaction is opened and how rows are locked.

Leases. A claimed item is `running` with a lease token and an expiry. The runner that
holds it renews the lease while the item runs (`renew`); `requeue_expired` puts items
whose lease ran out back to `pending`, so the items of a gateway that died (kill -9, a
lost node) are run by the others once the lease has passed. An item may therefore run
twice (a gateway stalled past its lease), but it gets exactly one result: a result is
written only by the current lease holder (`state = 'running' AND lease_token = ?`), in
the same transaction that moves the item out of `running`, and results are unique per
(job, custom_id) (`ON CONFLICT DO NOTHING`).

Locking. Every write that changes a job's items locks the job's row first (PostgreSQL
`FOR UPDATE`; SQLite's write lock covers the whole file), so two gateways finishing the
job's last two items cannot both miss that the job is done, and result positions stay
dense. Claiming picks the item with `FOR UPDATE SKIP LOCKED`.

Times are Unix seconds from the injected `wall_time` (leases included): gateways that
share a store need clocks in sync (NTP); a skew of S seconds moves a takeover by S.
"""

from __future__ import annotations

import abc
import os
import secrets
import socket
from collections.abc import Awaitable, Callable, Sequence
from typing import Any, Protocol, TypeVar

from qosgate.errors import InvalidArgument, NotFound, QuotaExceeded, QuotaViolation
from qosgate.jobs.model import (
    ClaimedItem,
    ItemError,
    ItemKind,
    ItemResult,
    Job,
    JobCounts,
    JobLimits,
    JobStatus,
    NewItem,
)

T = TypeVar("T")

# An upload that receives no chunk for this long is dropped (its client went away, or
# the gateway receiving it died): `expire` deletes it like a job past its retention.
UPLOAD_IDLE_S = 900.0

_ACTIVE = (JobStatus.QUEUED.value, JobStatus.RUNNING.value)
_JOB_COLUMNS = (
    "id, tenant, status, model, description, callback_url, created_at, started_at,"
    " finished_at, expires_at"
)
# Placeholders per statement when a list goes into `IN (...)`: far below SQLite's and
# PostgreSQL's limits on parameters.
_IN_LIST_MAX = 500

# The tables in either dialect: {real} is a float column type, {blob} a bytes one.
TABLES = """
CREATE TABLE IF NOT EXISTS batch_jobs (
    id TEXT PRIMARY KEY,
    tenant TEXT NOT NULL,
    status TEXT NOT NULL,
    model TEXT NOT NULL,
    description TEXT NOT NULL,
    callback_url TEXT NOT NULL,
    callback_pending INTEGER NOT NULL DEFAULT 0,  -- 1 from finish until the POST was made
    callback_not_before {real} NOT NULL DEFAULT 0, -- until then one gateway is sending it
    retention_s {real} NOT NULL,
    created_at {real} NOT NULL,
    started_at {real},
    finished_at {real},
    expires_at {real}            -- finished: finished_at + retention_s, uploading: idle limit
);
CREATE TABLE IF NOT EXISTS batch_items (
    job_id TEXT NOT NULL REFERENCES batch_jobs (id) ON DELETE CASCADE,
    seq INTEGER NOT NULL,                         -- submission order
    custom_id TEXT NOT NULL,
    kind TEXT NOT NULL,
    payload {blob} NOT NULL,
    state TEXT NOT NULL,                          -- pending, running, succeeded, failed, cancelled
    attempts INTEGER NOT NULL DEFAULT 0,
    not_before {real} NOT NULL DEFAULT 0,         -- retry backoff (Unix seconds)
    lease_token TEXT,                             -- running: which claim holds it
    lease_expires_at {real},                      -- running: when others may take it over
    PRIMARY KEY (job_id, seq),
    UNIQUE (job_id, custom_id)
);
CREATE TABLE IF NOT EXISTS batch_results (
    job_id TEXT NOT NULL REFERENCES batch_jobs (id) ON DELETE CASCADE,
    position INTEGER NOT NULL,                    -- completion order, from 0
    custom_id TEXT NOT NULL,
    kind TEXT NOT NULL,
    payload {blob},
    error_kind TEXT,
    error_message TEXT,
    attempts INTEGER NOT NULL,
    completed_at {real} NOT NULL,
    PRIMARY KEY (job_id, position),
    UNIQUE (job_id, custom_id)
);
"""
INDEXES = """
CREATE INDEX IF NOT EXISTS batch_jobs_by_tenant ON batch_jobs (tenant, created_at, id);
CREATE INDEX IF NOT EXISTS batch_items_by_state ON batch_items (job_id, state, seq);
CREATE INDEX IF NOT EXISTS batch_items_by_lease ON batch_items (state, lease_expires_at);
"""


def default_owner() -> str:
    """This process, as named in lease tokens (host and pid: where an item runs)."""
    return f"{socket.gethostname()}:{os.getpid()}"


class JobStore(Protocol):
    """Persistent batch jobs, items and results. Reads act as a tenant: another tenant's
    job reads exactly like a missing one. Every method is one transaction."""

    async def open(self) -> None:
        """Connect and create the tables if needed; before any other call. A store out
        of reach does not fail this: its calls raise Unavailable until it answers."""
        ...

    async def begin_job(
        self, tenant: str, *, model: str, description: str, callback_url: str, limits: JobLimits
    ) -> str:
        """Start an upload; the job stays invisible until `seal_job`."""
        ...

    async def add_items(self, job_id: str, items: Sequence[NewItem], *, limits: JobLimits) -> None:
        """Append a chunk of an upload. Raises InvalidArgument on an empty or repeated
        custom_id, QuotaExceeded when the tenant would have too many items waiting, and
        NotFound when the upload is gone (discarded, or idle past UPLOAD_IDLE_S)."""
        ...

    async def seal_job(self, job_id: str) -> Job:
        """End an upload: the job is queued and its items become eligible for dispatch."""
        ...

    async def discard_job(self, job_id: str) -> None:
        """Drop an upload that failed or was abandoned."""
        ...

    async def get_job(self, tenant: str, job_id: str) -> Job:
        """The tenant's job; another tenant's (or an unknown) id is NotFound."""
        ...

    async def list_jobs(self, tenant: str, *, limit: int, after_id: str | None = None) -> list[Job]:
        """The tenant's jobs, newest first, starting after the job `after_id`."""
        ...

    async def results(self, tenant: str, job_id: str, *, offset: int, limit: int) -> list[ItemResult]:
        """Results in completion order from `offset` (at most `limit`)."""
        ...

    async def cancel_job(self, tenant: str, job_id: str) -> Job:
        """Cancel the items not yet dispatched. The job is CANCELLING while dispatched
        items finish (their holders see it at their next `renew`), CANCELLED after; a
        finished job is returned unchanged."""
        ...

    async def recover(self) -> int:
        """Once at start: release what a previous run of this gateway left running that
        no other gateway can hold. Returns the items put back in the queue."""
        ...

    async def requeue_expired(self) -> int:
        """Put items whose lease ran out back to `pending` (to `cancelled` in a job being
        cancelled), finishing jobs that this leaves with nothing open. Returns how many."""
        ...

    async def work_by_tenant(self) -> dict[str, list[str]]:
        """Active jobs that have an item eligible for dispatch now, by tenant, each
        tenant's oldest job first."""
        ...

    async def next_retry_at(self) -> float | None:
        """The earliest time a backed-off item of an active job becomes eligible."""
        ...

    async def claim(self, job_id: str) -> ClaimedItem | None:
        """Lease the job's first eligible pending item to this store's owner for
        dispatch (None if there is none)."""
        ...

    async def renew(self, items: Sequence[ClaimedItem]) -> list[ClaimedItem]:
        """Extend the leases of `items`; returns those to stop: leases lost to another
        gateway, or items of a job being cancelled (whose lease is not extended)."""
        ...

    async def succeed(self, item: ClaimedItem, payload: bytes) -> Job | None:
        """Record an item's result if `item` still holds its lease; returns the job if
        this finished it."""
        ...

    async def fail(self, item: ClaimedItem, error: ItemError) -> Job | None:
        """Record an item's permanent failure (as `succeed`)."""
        ...

    async def retry_later(
        self, item: ClaimedItem, not_before: float, *, count_attempt: bool = True
    ) -> Job | None:
        """Put a dispatched item back (transient failure); in a job being cancelled it is
        cancelled instead. `count_attempt=False` gives the attempt back (the item never
        reached the model). Returns the job if this finished it."""
        ...

    async def abandon(self, item: ClaimedItem) -> Job | None:
        """A dispatched item stopped because its job was cancelled: it counts as cancelled."""
        ...

    async def job_status(self, job_id: str) -> JobStatus | None:
        """Any tenant's job status (for the runner); None once the job is gone."""
        ...

    async def callbacks_due(self, hold_s: float) -> list[Job]:
        """Finished jobs whose completion callback has not been made yet and that no
        gateway is sending now; each is reserved to the caller for `hold_s` (after that,
        any gateway retries it). The gateway that finishes a job holds its callback for
        the lease, so it sends it first and alone."""
        ...

    async def callback_made(self, job_id: str) -> None:
        """The job's completion callback was accepted."""
        ...

    async def expire(self) -> int:
        """Delete finished jobs past their retention (and idle uploads), with their items
        and results. Returns how many jobs."""
        ...

    async def close(self) -> None:
        """Release the connections."""
        ...


class SqlSession(Protocol):
    """One open transaction; statements use `?` placeholders whatever the dialect."""

    async def execute(self, sql: str, args: Sequence[Any] = ()) -> int:
        """Run a statement; returns the rows it changed."""
        ...

    async def execute_many(self, sql: str, rows: Sequence[Sequence[Any]]) -> None:
        """Run a statement once per row of arguments."""
        ...

    async def one(self, sql: str, args: Sequence[Any] = ()) -> tuple[Any, ...] | None:
        """The first row of a query (None if it has none)."""
        ...

    async def all(self, sql: str, args: Sequence[Any] = ()) -> list[tuple[Any, ...]]:
        """Every row of a query."""
        ...


def _marks(count: int) -> str:
    return ", ".join("?" * count)


class SqlJobStore(abc.ABC):
    """The JobStore operations as SQL; subclasses open transactions and say how to lock."""

    # Appended to the SELECT of a job row in a write transaction: holds it to the end.
    LOCK_ROW = ""
    # Appended to the SELECT of the item to claim: skip items another claim holds.
    SKIP_LOCKED = ""

    def __init__(self, *, wall_time: Callable[[], float], lease_s: float, owner: str) -> None:
        self._wall_time = wall_time
        self.lease_s = lease_s
        self._owner = owner

    @abc.abstractmethod
    async def _write(self, work: Callable[[SqlSession], Awaitable[T]]) -> T:
        """Run `work` in a write transaction (committed if it returns, rolled back if it
        raises)."""

    @abc.abstractmethod
    async def _read(self, work: Callable[[SqlSession], Awaitable[T]]) -> T:
        """Run `work`, which only reads."""

    async def _lock_tenant(self, db: SqlSession, tenant: str) -> None:
        """Serialize this transaction with others of `tenant` that count its waiting
        items (two uploads on two gateways must not both pass the limit)."""

    # -- submission ------------------------------------------------------------------

    async def begin_job(
        self, tenant: str, *, model: str, description: str, callback_url: str, limits: JobLimits
    ) -> str:
        job_id = f"batch_{secrets.token_hex(8)}"
        now = self._wall_time()

        async def work(db: SqlSession) -> None:
            await db.execute(
                "INSERT INTO batch_jobs (id, tenant, status, model, description, callback_url,"
                " retention_s, created_at, expires_at) VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?)",
                (
                    job_id,
                    tenant,
                    JobStatus.UPLOADING.value,
                    model,
                    description,
                    callback_url,
                    limits.retention_s,
                    now,
                    now + UPLOAD_IDLE_S,
                ),
            )

        await self._write(work)
        return job_id

    async def add_items(self, job_id: str, items: Sequence[NewItem], *, limits: JobLimits) -> None:
        async def work(db: SqlSession) -> None:
            row = await db.one(
                "SELECT tenant FROM batch_jobs WHERE id = ? AND status = ?" + self.LOCK_ROW,
                (job_id, JobStatus.UPLOADING.value),
            )
            if row is None:
                raise NotFound(f"no upload in progress for batch {job_id!r}")
            (tenant,) = row
            await self._lock_tenant(db, tenant)
            (next_seq,) = await self._one(
                db, "SELECT COALESCE(MAX(seq) + 1, 0) FROM batch_items WHERE job_id = ?", (job_id,)
            )
            waiting = await self._waiting_items(db, tenant)
            if waiting + len(items) > limits.max_queued_items:
                raise QuotaExceeded(
                    f"tenant {tenant!r} may have at most {limits.max_queued_items} batch items"
                    f" waiting; {waiting} already are and this job adds more",
                    retry_after_s=60.0,
                    violations=(
                        QuotaViolation(
                            subject=f"tenant:{tenant}",
                            description=f"batch items waiting > {limits.max_queued_items}",
                        ),
                    ),
                )
            await self._refuse_repeated_ids(db, job_id, next_seq, items)
            await db.execute_many(
                "INSERT INTO batch_items (job_id, seq, custom_id, kind, payload, state)"
                " VALUES (?, ?, ?, ?, ?, 'pending')",
                [
                    (job_id, next_seq + offset, item.custom_id, item.kind.value, item.payload)
                    for offset, item in enumerate(items)
                ],
            )
            await db.execute(
                "UPDATE batch_jobs SET expires_at = ? WHERE id = ?",
                (self._wall_time() + UPLOAD_IDLE_S, job_id),
            )

        await self._write(work)

    @staticmethod
    async def _refuse_repeated_ids(
        db: SqlSession, job_id: str, next_seq: int, items: Sequence[NewItem]
    ) -> None:
        """InvalidArgument naming the first item whose custom_id is empty or already used
        (in this chunk or an earlier one)."""
        earlier: set[str] = set()
        for start in range(0, len(items), _IN_LIST_MAX):
            ids = [item.custom_id for item in items[start : start + _IN_LIST_MAX]]
            rows = await db.all(
                "SELECT custom_id FROM batch_items WHERE job_id = ?"
                f" AND custom_id IN ({_marks(len(ids))})",
                (job_id, *ids),
            )
            earlier.update(custom_id for (custom_id,) in rows)
        seen: set[str] = set()
        for offset, item in enumerate(items):
            if not item.custom_id:
                raise InvalidArgument(f"item {next_seq + offset}: custom_id is empty")
            if item.custom_id in seen or item.custom_id in earlier:
                raise InvalidArgument(
                    f"item {next_seq + offset}: custom_id {item.custom_id!r} is used twice"
                )
            seen.add(item.custom_id)

    async def seal_job(self, job_id: str) -> Job:
        async def work(db: SqlSession) -> Job:
            if await db.one("SELECT id FROM batch_jobs WHERE id = ?" + self.LOCK_ROW, (job_id,)) is None:
                raise NotFound(f"no upload in progress for batch {job_id!r}")
            (count,) = await self._one(db, "SELECT COUNT(*) FROM batch_items WHERE job_id = ?", (job_id,))
            if count == 0:
                raise InvalidArgument("a batch needs at least one item")
            await db.execute(
                "UPDATE batch_jobs SET status = ?, expires_at = NULL WHERE id = ? AND status = ?",
                (JobStatus.QUEUED.value, job_id, JobStatus.UPLOADING.value),
            )
            return await self._job(db, job_id)

        return await self._write(work)

    async def discard_job(self, job_id: str) -> None:
        async def work(db: SqlSession) -> None:
            await db.execute(
                "DELETE FROM batch_jobs WHERE id = ? AND status = ?",
                (job_id, JobStatus.UPLOADING.value),
            )

        await self._write(work)

    async def _waiting_items(self, db: SqlSession, tenant: str) -> int:
        (count,) = await self._one(
            db,
            "SELECT COUNT(*) FROM batch_items i JOIN batch_jobs j ON j.id = i.job_id"
            " WHERE j.tenant = ? AND i.state IN ('pending', 'running')",
            (tenant,),
        )
        return int(count)

    # -- reading, as a tenant ----------------------------------------------------------

    async def get_job(self, tenant: str, job_id: str) -> Job:
        return await self._read(lambda db: self._visible_job(db, tenant, job_id))

    async def list_jobs(self, tenant: str, *, limit: int, after_id: str | None = None) -> list[Job]:
        async def work(db: SqlSession) -> list[Job]:
            where, args = "tenant = ? AND status != ?", [tenant, JobStatus.UPLOADING.value]
            if after_id is not None:
                anchor = await db.one(
                    "SELECT created_at, id FROM batch_jobs WHERE id = ? AND tenant = ?",
                    (after_id, tenant),
                )
                if anchor is None:
                    raise InvalidArgument("page_token does not name one of your jobs")
                where += " AND (created_at, id) < (?, ?)"
                args += list(anchor)
            ids = await db.all(
                f"SELECT id FROM batch_jobs WHERE {where} ORDER BY created_at DESC, id DESC"
                " LIMIT ?",
                (*args, limit),
            )
            return [await self._job(db, job_id) for (job_id,) in ids]

        return await self._read(work)

    async def results(self, tenant: str, job_id: str, *, offset: int, limit: int) -> list[ItemResult]:
        async def work(db: SqlSession) -> list[tuple[Any, ...]]:
            await self._visible_job(db, tenant, job_id)
            return await db.all(
                "SELECT position, custom_id, kind, payload, error_kind, error_message, attempts,"
                " completed_at FROM batch_results WHERE job_id = ? AND position >= ?"
                " ORDER BY position LIMIT ?",
                (job_id, offset, limit),
            )

        return [
            ItemResult(
                offset=position,
                custom_id=custom_id,
                kind=ItemKind(kind),
                payload=None if payload is None else bytes(payload),
                error=ItemError(error_kind, error_message) if error_kind else None,
                attempts=attempts,
                completed_at=completed_at,
            )
            for position, custom_id, kind, payload, error_kind, error_message, attempts, completed_at in await self._read(work)
        ]

    async def cancel_job(self, tenant: str, job_id: str) -> Job:
        async def work(db: SqlSession) -> Job:
            job = await self._visible_job(db, tenant, job_id, lock=True)
            if job.status not in (JobStatus.QUEUED, JobStatus.RUNNING):
                return job
            await db.execute(
                "UPDATE batch_items SET state = 'cancelled' WHERE job_id = ? AND state = 'pending'",
                (job_id,),
            )
            await db.execute(
                "UPDATE batch_jobs SET status = ? WHERE id = ?",
                (JobStatus.CANCELLING.value, job_id),
            )
            await self._settle(db, job_id)
            return await self._job(db, job_id)

        return await self._write(work)

    # -- dispatch, for the runner ------------------------------------------------------

    async def recover(self) -> int:
        # Shared: what another gateway runs is its own until its lease runs out.
        return await self.requeue_expired()

    async def requeue_expired(self) -> int:
        now = self._wall_time()
        jobs = await self._read(
            lambda db: db.all(
                "SELECT DISTINCT job_id FROM batch_items WHERE state = 'running'"
                " AND lease_expires_at <= ?",
                (now,),
            )
        )

        async def work(db: SqlSession, job_id: str) -> int:
            row = await db.one("SELECT status FROM batch_jobs WHERE id = ?" + self.LOCK_ROW, (job_id,))
            if row is None:
                return 0
            state = "cancelled" if row[0] == JobStatus.CANCELLING.value else "pending"
            moved = await db.execute(
                "UPDATE batch_items SET state = ?, lease_token = NULL, lease_expires_at = NULL"
                " WHERE job_id = ? AND state = 'running' AND lease_expires_at <= ?",
                (state, job_id, now),
            )
            await self._settle(db, job_id)
            return moved

        total = 0
        for (job_id,) in jobs:
            total += await self._write(lambda db: work(db, job_id))
        return total

    async def work_by_tenant(self) -> dict[str, list[str]]:
        rows = await self._read(
            lambda db: db.all(
                "SELECT j.tenant, j.id FROM batch_jobs j WHERE j.status IN (?, ?) AND EXISTS"
                " (SELECT 1 FROM batch_items i WHERE i.job_id = j.id AND i.state = 'pending'"
                " AND i.not_before <= ?) ORDER BY j.created_at, j.id",
                (*_ACTIVE, self._wall_time()),
            )
        )
        work: dict[str, list[str]] = {}
        for tenant, job_id in rows:
            work.setdefault(tenant, []).append(job_id)
        return work

    async def next_retry_at(self) -> float | None:
        row = await self._read(
            lambda db: db.one(
                "SELECT MIN(i.not_before) FROM batch_items i JOIN batch_jobs j ON j.id = i.job_id"
                " WHERE j.status IN (?, ?) AND i.state = 'pending'",
                _ACTIVE,
            )
        )
        return None if row is None else row[0]

    async def claim(self, job_id: str) -> ClaimedItem | None:
        now = self._wall_time()
        token = f"{self._owner}/{secrets.token_hex(6)}"

        async def work(db: SqlSession) -> ClaimedItem | None:
            job = await db.one(
                "SELECT tenant, status, created_at FROM batch_jobs WHERE id = ?" + self.LOCK_ROW, (job_id,)
            )
            if job is None or job[1] not in _ACTIVE:
                return None
            tenant, status, created_at = job
            row = await db.one(
                "SELECT seq, custom_id, kind, payload, attempts FROM batch_items"
                " WHERE job_id = ? AND state = 'pending' AND not_before <= ?"
                " ORDER BY seq LIMIT 1" + self.SKIP_LOCKED,
                (job_id, now),
            )
            if row is None:
                return None
            seq, custom_id, kind, payload, attempts = row
            await db.execute(
                "UPDATE batch_items SET state = 'running', attempts = attempts + 1,"
                " lease_token = ?, lease_expires_at = ? WHERE job_id = ? AND seq = ?",
                (token, now + self.lease_s, job_id, seq),
            )
            if status == JobStatus.QUEUED.value:
                await db.execute(
                    "UPDATE batch_jobs SET status = ?, started_at = COALESCE(started_at, ?)"
                    " WHERE id = ?",
                    (JobStatus.RUNNING.value, now, job_id),
                )
            return ClaimedItem(
                job_id, seq, tenant, custom_id, ItemKind(kind), bytes(payload), attempts + 1, token, float(created_at)
            )

        return await self._write(work)

    async def renew(self, items: Sequence[ClaimedItem]) -> list[ClaimedItem]:
        expires = self._wall_time() + self.lease_s

        async def work(db: SqlSession, tokens: list[str]) -> list[tuple[Any, ...]]:
            return await db.all(
                "UPDATE batch_items SET lease_expires_at = ? WHERE state = 'running'"
                f" AND lease_token IN ({_marks(len(tokens))}) AND job_id IN"
                " (SELECT id FROM batch_jobs WHERE status IN (?, ?)) RETURNING lease_token",
                (expires, *tokens, *_ACTIVE),
            )

        held: set[str] = set()
        for start in range(0, len(items), _IN_LIST_MAX):
            tokens = [item.lease_token for item in items[start : start + _IN_LIST_MAX]]
            rows = await self._write(lambda db: work(db, tokens))
            held.update(token for (token,) in rows)
        return [item for item in items if item.lease_token not in held]

    async def succeed(self, item: ClaimedItem, payload: bytes) -> Job | None:
        return await self._record(item, "succeeded", payload, None)

    async def fail(self, item: ClaimedItem, error: ItemError) -> Job | None:
        return await self._record(item, "failed", None, error)

    async def retry_later(
        self, item: ClaimedItem, not_before: float, *, count_attempt: bool = True
    ) -> Job | None:
        async def work(db: SqlSession) -> Job | None:
            row = await db.one("SELECT status FROM batch_jobs WHERE id = ?" + self.LOCK_ROW, (item.job_id,))
            cancelling = row is not None and row[0] == JobStatus.CANCELLING.value
            await db.execute(
                "UPDATE batch_items SET state = ?, not_before = ?, attempts = attempts - ?,"
                " lease_token = NULL, lease_expires_at = NULL"
                " WHERE job_id = ? AND seq = ? AND state = 'running' AND lease_token = ?",
                (
                    "cancelled" if cancelling else "pending",
                    not_before,
                    0 if count_attempt else 1,
                    item.job_id,
                    item.seq,
                    item.lease_token,
                ),
            )
            return await self._settle(db, item.job_id)

        return await self._write(work)

    async def abandon(self, item: ClaimedItem) -> Job | None:
        return await self._record(item, "cancelled", None, None, with_result=False)

    async def job_status(self, job_id: str) -> JobStatus | None:
        row = await self._read(lambda db: db.one("SELECT status FROM batch_jobs WHERE id = ?", (job_id,)))
        return JobStatus(row[0]) if row else None

    async def _record(
        self,
        item: ClaimedItem,
        state: str,
        payload: bytes | None,
        error: ItemError | None,
        *,
        with_result: bool = True,
    ) -> Job | None:
        async def work(db: SqlSession) -> Job | None:
            await db.one("SELECT id FROM batch_jobs WHERE id = ?" + self.LOCK_ROW, (item.job_id,))
            moved = await db.execute(
                "UPDATE batch_items SET state = ?, lease_token = NULL, lease_expires_at = NULL"
                " WHERE job_id = ? AND seq = ? AND state = 'running' AND lease_token = ?",
                (state, item.job_id, item.seq, item.lease_token),
            )
            if moved and with_result:
                await db.execute(
                    "INSERT INTO batch_results (job_id, position, custom_id, kind, payload,"
                    " error_kind, error_message, attempts, completed_at) VALUES (?, (SELECT"
                    " COALESCE(MAX(position) + 1, 0) FROM batch_results WHERE job_id = ?),"
                    " ?, ?, ?, ?, ?, ?, ?) ON CONFLICT (job_id, custom_id) DO NOTHING",
                    (
                        item.job_id,
                        item.job_id,
                        item.custom_id,
                        item.kind.value,
                        payload,
                        error.kind if error else None,
                        error.message if error else None,
                        item.attempt,
                        self._wall_time(),
                    ),
                )
            return await self._settle(db, item.job_id)

        return await self._write(work)

    # -- completion callbacks and retention ---------------------------------------------

    async def callbacks_due(self, hold_s: float) -> list[Job]:
        now = self._wall_time()

        async def work(db: SqlSession) -> list[Job]:
            ids = await db.all(
                "UPDATE batch_jobs SET callback_not_before = ? WHERE callback_pending = 1"
                " AND callback_not_before <= ? RETURNING id",
                (now + hold_s, now),
            )
            return [await self._job(db, job_id) for (job_id,) in ids]

        return await self._write(work)

    async def callback_made(self, job_id: str) -> None:
        async def work(db: SqlSession) -> None:
            await db.execute("UPDATE batch_jobs SET callback_pending = 0 WHERE id = ?", (job_id,))

        await self._write(work)

    async def expire(self) -> int:
        async def work(db: SqlSession) -> int:
            return await db.execute(
                "DELETE FROM batch_jobs WHERE expires_at IS NOT NULL AND expires_at <= ?",
                (self._wall_time(),),
            )

        return await self._write(work)

    # -- internals ---------------------------------------------------------------------

    @staticmethod
    async def _one(db: SqlSession, sql: str, args: Sequence[Any]) -> tuple[Any, ...]:
        """The row of a query that always has one (an aggregate)."""
        row = await db.one(sql, args)
        assert row is not None
        return row

    async def _settle(self, db: SqlSession, job_id: str) -> Job | None:
        """Finish the job if no item is pending or running; returns it if it just finished.
        The caller holds the job's row, so a concurrent finish of its last items is seen."""
        (open_items,) = await self._one(
            db,
            "SELECT COUNT(*) FROM batch_items WHERE job_id = ? AND state IN ('pending', 'running')",
            (job_id,),
        )
        if open_items:
            return None
        now = self._wall_time()
        finished = await db.execute(
            "UPDATE batch_jobs SET status = CASE status WHEN ? THEN ? ELSE ? END,"
            " finished_at = ?, expires_at = ? + retention_s,"
            " callback_pending = CASE WHEN callback_url != '' THEN 1 ELSE 0 END,"
            " callback_not_before = ? WHERE id = ? AND status IN (?, ?, ?)",
            (
                JobStatus.CANCELLING.value,
                JobStatus.CANCELLED.value,
                JobStatus.COMPLETED.value,
                now,
                now,
                now + self.lease_s,
                job_id,
                *_ACTIVE,
                JobStatus.CANCELLING.value,
            ),
        )
        return await self._job(db, job_id) if finished else None

    async def _visible_job(self, db: SqlSession, tenant: str, job_id: str, *, lock: bool = False) -> Job:
        row = await db.one(
            "SELECT tenant, status FROM batch_jobs WHERE id = ?" + (self.LOCK_ROW if lock else ""),
            (job_id,),
        )
        # Another tenant's job reads exactly like a missing one: ids must not leak.
        if row is None or row[0] != tenant or row[1] == JobStatus.UPLOADING.value:
            raise NotFound(f"no batch {job_id!r}")
        return await self._job(db, job_id)

    @classmethod
    async def _job(cls, db: SqlSession, job_id: str) -> Job:
        (
            id_,
            tenant,
            status,
            model,
            description,
            callback_url,
            created_at,
            started_at,
            finished_at,
            expires_at,
        ) = await cls._one(db, f"SELECT {_JOB_COLUMNS} FROM batch_jobs WHERE id = ?", (job_id,))
        by_state = dict(
            await db.all(
                "SELECT state, COUNT(*) FROM batch_items WHERE job_id = ? GROUP BY state",
                (job_id,),
            )
        )
        counts = JobCounts(
            total=sum(by_state.values()),
            pending=by_state.get("pending", 0),
            running=by_state.get("running", 0),
            succeeded=by_state.get("succeeded", 0),
            failed=by_state.get("failed", 0),
            cancelled=by_state.get("cancelled", 0),
        )
        return Job(
            id=id_,
            tenant=tenant,
            status=JobStatus(status),
            model=model,
            description=description,
            callback_url=callback_url,
            counts=counts,
            created_at=created_at,
            started_at=started_at,
            finished_at=finished_at,
            expires_at=expires_at,
        )
