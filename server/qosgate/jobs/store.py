"""Jobs, items and results in one SQLite file (WAL), so a job survives a kill -9.

Exactly one result per custom_id holds by construction: an item moves out of `running`
and its result row is written in the same transaction, guarded by the item's state, and
results are keyed by (job, custom_id). A kill -9 leaves at most the items that were at the
model in `running`; `recover()` puts them back to `pending`, so they run again and their
first (only) result is the one recorded.

Durability (see `qosgate.database`): a commit survives a kill -9; only an OS crash may
drop the last commits, which then behave like items that were in flight.
"""

from __future__ import annotations

import secrets
import sqlite3
import threading
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path

from qosgate.database import open_database
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

_SCHEMA = """
CREATE TABLE IF NOT EXISTS batch_jobs (
    id TEXT PRIMARY KEY,
    tenant TEXT NOT NULL,
    status TEXT NOT NULL,
    model TEXT NOT NULL,
    description TEXT NOT NULL,
    callback_url TEXT NOT NULL,
    callback_pending INTEGER NOT NULL DEFAULT 0,  -- 1 from finish until the POST was made
    retention_s REAL NOT NULL,
    created_at REAL NOT NULL,
    started_at REAL,
    finished_at REAL,
    expires_at REAL                               -- finished_at + retention_s
);
CREATE INDEX IF NOT EXISTS batch_jobs_by_tenant ON batch_jobs (tenant, created_at, id);
CREATE TABLE IF NOT EXISTS batch_items (
    job_id TEXT NOT NULL REFERENCES batch_jobs (id) ON DELETE CASCADE,
    seq INTEGER NOT NULL,                         -- submission order
    custom_id TEXT NOT NULL,
    kind TEXT NOT NULL,
    payload BLOB NOT NULL,
    state TEXT NOT NULL,                          -- pending, running, succeeded, failed, cancelled
    attempts INTEGER NOT NULL DEFAULT 0,
    not_before REAL NOT NULL DEFAULT 0,           -- retry backoff (Unix seconds)
    PRIMARY KEY (job_id, seq),
    UNIQUE (job_id, custom_id)
);
CREATE INDEX IF NOT EXISTS batch_items_by_state ON batch_items (job_id, state, seq);
CREATE TABLE IF NOT EXISTS batch_results (
    job_id TEXT NOT NULL REFERENCES batch_jobs (id) ON DELETE CASCADE,
    position INTEGER NOT NULL,                    -- completion order, from 0
    custom_id TEXT NOT NULL,
    kind TEXT NOT NULL,
    payload BLOB,
    error_kind TEXT,
    error_message TEXT,
    attempts INTEGER NOT NULL,
    completed_at REAL NOT NULL,
    PRIMARY KEY (job_id, position),
    UNIQUE (job_id, custom_id)
);
"""

_ACTIVE = (JobStatus.QUEUED.value, JobStatus.RUNNING.value)
_JOB_COLUMNS = (
    "id, tenant, status, model, description, callback_url, created_at, started_at,"
    " finished_at, expires_at"
)


class JobStore:
    """Persistent batch jobs; every method is one transaction; safe to share between threads."""

    def __init__(self, path: Path | str, *, wall_time: Callable[[], float]) -> None:
        """Open (creating if needed) the store at `path`; `wall_time` gives Unix seconds."""
        self._wall_time = wall_time
        self._db = open_database(path, _SCHEMA)
        self._lock = threading.Lock()

    def close(self) -> None:
        with self._lock:
            self._db.close()

    @contextmanager
    def _transaction(self) -> Iterator[sqlite3.Connection]:
        with self._lock:
            self._db.execute("BEGIN IMMEDIATE")
            try:
                yield self._db
            except BaseException:
                self._db.execute("ROLLBACK")
                raise
            self._db.execute("COMMIT")

    # -- submission ------------------------------------------------------------------

    def begin_job(
        self, tenant: str, *, model: str, description: str, callback_url: str, limits: JobLimits
    ) -> str:
        """Start an upload; the job stays invisible until `seal_job`."""
        job_id = f"batch_{secrets.token_hex(8)}"
        with self._transaction() as db:
            db.execute(
                "INSERT INTO batch_jobs (id, tenant, status, model, description, callback_url,"
                " retention_s, created_at) VALUES (?, ?, ?, ?, ?, ?, ?, ?)",
                (
                    job_id,
                    tenant,
                    JobStatus.UPLOADING.value,
                    model,
                    description,
                    callback_url,
                    limits.retention_s,
                    self._wall_time(),
                ),
            )
        return job_id

    def add_items(self, job_id: str, items: Sequence[NewItem], *, limits: JobLimits) -> None:
        """Append a chunk of an upload. Raises InvalidArgument on an empty or repeated
        custom_id and QuotaExceeded when the tenant would have too many items waiting."""
        with self._transaction() as db:
            row = db.execute(
                "SELECT tenant, (SELECT COALESCE(MAX(seq) + 1, 0) FROM batch_items"
                " WHERE job_id = ?) FROM batch_jobs WHERE id = ? AND status = ?",
                (job_id, job_id, JobStatus.UPLOADING.value),
            ).fetchone()
            if row is None:
                raise NotFound(f"no upload in progress for batch {job_id!r}")
            tenant, next_seq = row
            waiting = self._waiting_items(db, tenant)
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
            for offset, item in enumerate(items):
                if not item.custom_id:
                    raise InvalidArgument(f"item {next_seq + offset}: custom_id is empty")
                try:
                    db.execute(
                        "INSERT INTO batch_items (job_id, seq, custom_id, kind, payload, state)"
                        " VALUES (?, ?, ?, ?, ?, 'pending')",
                        (job_id, next_seq + offset, item.custom_id, item.kind.value, item.payload),
                    )
                except sqlite3.IntegrityError:
                    raise InvalidArgument(
                        f"item {next_seq + offset}: custom_id {item.custom_id!r} is used twice"
                    ) from None

    def seal_job(self, job_id: str) -> Job:
        """End an upload: the job is queued and its items become eligible for dispatch."""
        with self._transaction() as db:
            (count,) = db.execute(
                "SELECT COUNT(*) FROM batch_items WHERE job_id = ?", (job_id,)
            ).fetchone()
            if count == 0:
                raise InvalidArgument("a batch needs at least one item")
            db.execute(
                "UPDATE batch_jobs SET status = ? WHERE id = ? AND status = ?",
                (JobStatus.QUEUED.value, job_id, JobStatus.UPLOADING.value),
            )
            return self._job(db, job_id)

    def discard_job(self, job_id: str) -> None:
        """Drop an upload that failed or was abandoned."""
        with self._transaction() as db:
            db.execute(
                "DELETE FROM batch_jobs WHERE id = ? AND status = ?",
                (job_id, JobStatus.UPLOADING.value),
            )

    @staticmethod
    def _waiting_items(db: sqlite3.Connection, tenant: str) -> int:
        (count,) = db.execute(
            "SELECT COUNT(*) FROM batch_items i JOIN batch_jobs j ON j.id = i.job_id"
            " WHERE j.tenant = ? AND i.state IN ('pending', 'running')",
            (tenant,),
        ).fetchone()
        return int(count)

    # -- reading, as a tenant ----------------------------------------------------------

    def get_job(self, tenant: str, job_id: str) -> Job:
        """The tenant's job; another tenant's (or an unknown) id is NotFound."""
        with self._lock:
            return self._visible_job(self._db, tenant, job_id)

    def list_jobs(self, tenant: str, *, limit: int, after_id: str | None = None) -> list[Job]:
        """The tenant's jobs, newest first, starting after the job `after_id`."""
        with self._lock:
            where, args = "tenant = ? AND status != ?", [tenant, JobStatus.UPLOADING.value]
            if after_id is not None:
                anchor = self._db.execute(
                    "SELECT created_at, id FROM batch_jobs WHERE id = ? AND tenant = ?",
                    (after_id, tenant),
                ).fetchone()
                if anchor is None:
                    raise InvalidArgument("page_token does not name one of your jobs")
                where += " AND (created_at, id) < (?, ?)"
                args += list(anchor)
            ids = self._db.execute(
                f"SELECT id FROM batch_jobs WHERE {where} ORDER BY created_at DESC, id DESC"
                " LIMIT ?",
                (*args, limit),
            ).fetchall()
            return [self._job(self._db, job_id) for (job_id,) in ids]

    def results(self, tenant: str, job_id: str, *, offset: int, limit: int) -> list[ItemResult]:
        """Results in completion order from `offset` (at most `limit`)."""
        with self._lock:
            self._visible_job(self._db, tenant, job_id)
            rows = self._db.execute(
                "SELECT position, custom_id, kind, payload, error_kind, error_message, attempts,"
                " completed_at FROM batch_results WHERE job_id = ? AND position >= ?"
                " ORDER BY position LIMIT ?",
                (job_id, offset, limit),
            ).fetchall()
        return [
            ItemResult(
                offset=position,
                custom_id=custom_id,
                kind=ItemKind(kind),
                payload=payload,
                error=ItemError(error_kind, error_message) if error_kind else None,
                attempts=attempts,
                completed_at=completed_at,
            )
            for position, custom_id, kind, payload, error_kind, error_message, attempts, completed_at in rows
        ]

    def cancel_job(self, tenant: str, job_id: str) -> Job:
        """Cancel the items not yet dispatched. The job is CANCELLING while dispatched items
        finish, CANCELLED after; a finished job is returned unchanged."""
        with self._transaction() as db:
            job = self._visible_job(db, tenant, job_id)
            if job.status not in (JobStatus.QUEUED, JobStatus.RUNNING):
                return job
            db.execute(
                "UPDATE batch_items SET state = 'cancelled' WHERE job_id = ? AND state = 'pending'",
                (job_id,),
            )
            db.execute(
                "UPDATE batch_jobs SET status = ? WHERE id = ?",
                (JobStatus.CANCELLING.value, job_id),
            )
            self._settle(db, job_id)
            return self._job(db, job_id)

    # -- dispatch, for the runner ------------------------------------------------------

    def recover(self) -> int:
        """After a restart: re-queue items that were at the model when the process died,
        drop unfinished uploads, finish what is finished. Returns the items re-queued."""
        with self._transaction() as db:
            db.execute("DELETE FROM batch_jobs WHERE status = ?", (JobStatus.UPLOADING.value,))
            requeued = db.execute(
                "UPDATE batch_items SET state = 'pending' WHERE state = 'running'"
            ).rowcount
            # A job cancelled while its items ran: they are pending again now, so cancel them.
            db.execute(
                "UPDATE batch_items SET state = 'cancelled' WHERE state = 'pending' AND job_id IN"
                " (SELECT id FROM batch_jobs WHERE status = ?)",
                (JobStatus.CANCELLING.value,),
            )
            for (job_id,) in db.execute(
                "SELECT id FROM batch_jobs WHERE status IN (?, ?, ?)",
                (*_ACTIVE, JobStatus.CANCELLING.value),
            ).fetchall():
                self._settle(db, job_id)
            return requeued

    def work_by_tenant(self) -> dict[str, list[str]]:
        """Active jobs that have an item eligible for dispatch now, by tenant, each
        tenant's oldest job first."""
        with self._lock:
            rows = self._db.execute(
                "SELECT j.tenant, j.id FROM batch_jobs j WHERE j.status IN (?, ?) AND EXISTS"
                " (SELECT 1 FROM batch_items i WHERE i.job_id = j.id AND i.state = 'pending'"
                " AND i.not_before <= ?) ORDER BY j.created_at, j.id",
                (*_ACTIVE, self._wall_time()),
            ).fetchall()
        work: dict[str, list[str]] = {}
        for tenant, job_id in rows:
            work.setdefault(tenant, []).append(job_id)
        return work

    def next_retry_at(self) -> float | None:
        """The earliest time a backed-off item of an active job becomes eligible."""
        with self._lock:
            (when,) = self._db.execute(
                "SELECT MIN(i.not_before) FROM batch_items i JOIN batch_jobs j ON j.id = i.job_id"
                " WHERE j.status IN (?, ?) AND i.state = 'pending'",
                _ACTIVE,
            ).fetchone()
        return when

    def claim(self, job_id: str) -> ClaimedItem | None:
        """Take the job's first eligible pending item for dispatch (None if there is none)."""
        now = self._wall_time()
        with self._transaction() as db:
            row = db.execute(
                "SELECT i.seq, j.tenant, i.custom_id, i.kind, i.payload, i.attempts"
                " FROM batch_items i JOIN batch_jobs j ON j.id = i.job_id"
                " WHERE i.job_id = ? AND j.status IN (?, ?) AND i.state = 'pending'"
                " AND i.not_before <= ? ORDER BY i.seq LIMIT 1",
                (job_id, *_ACTIVE, now),
            ).fetchone()
            if row is None:
                return None
            seq, tenant, custom_id, kind, payload, attempts = row
            db.execute(
                "UPDATE batch_items SET state = 'running', attempts = attempts + 1"
                " WHERE job_id = ? AND seq = ?",
                (job_id, seq),
            )
            db.execute(
                "UPDATE batch_jobs SET status = ?, started_at = COALESCE(started_at, ?)"
                " WHERE id = ? AND status = ?",
                (JobStatus.RUNNING.value, now, job_id, JobStatus.QUEUED.value),
            )
        return ClaimedItem(job_id, seq, tenant, custom_id, ItemKind(kind), payload, attempts + 1)

    def succeed(self, item: ClaimedItem, payload: bytes) -> Job | None:
        """Record an item's result; returns the job if this finished it."""
        return self._record(item, "succeeded", payload, None)

    def fail(self, item: ClaimedItem, error: ItemError) -> Job | None:
        """Record an item's permanent failure; returns the job if this finished it."""
        return self._record(item, "failed", None, error)

    def retry_later(
        self, item: ClaimedItem, not_before: float, *, count_attempt: bool = True
    ) -> Job | None:
        """Put a dispatched item back (transient failure); in a job being cancelled it is
        cancelled instead. `count_attempt=False` gives the attempt back (the item never
        reached the model). Returns the job if this finished it."""
        with self._transaction() as db:
            db.execute(
                "UPDATE batch_items SET state = CASE WHEN (SELECT status FROM batch_jobs"
                " WHERE id = ?) = ? THEN 'cancelled' ELSE 'pending' END, not_before = ?,"
                " attempts = attempts - ? WHERE job_id = ? AND seq = ? AND state = 'running'",
                (
                    item.job_id,
                    JobStatus.CANCELLING.value,
                    not_before,
                    0 if count_attempt else 1,
                    item.job_id,
                    item.seq,
                ),
            )
            return self._settle(db, item.job_id)

    def abandon(self, item: ClaimedItem) -> Job | None:
        """A dispatched item stopped because its job was cancelled: it counts as cancelled."""
        with self._transaction() as db:
            db.execute(
                "UPDATE batch_items SET state = 'cancelled' WHERE job_id = ? AND seq = ?"
                " AND state = 'running'",
                (item.job_id, item.seq),
            )
            return self._settle(db, item.job_id)

    def job_status(self, job_id: str) -> JobStatus | None:
        """Any tenant's job status (for the runner); None once the job is gone."""
        with self._lock:
            row = self._db.execute(
                "SELECT status FROM batch_jobs WHERE id = ?", (job_id,)
            ).fetchone()
        return JobStatus(row[0]) if row else None

    def _record(
        self, item: ClaimedItem, state: str, payload: bytes | None, error: ItemError | None
    ) -> Job | None:
        with self._transaction() as db:
            moved = db.execute(
                "UPDATE batch_items SET state = ? WHERE job_id = ? AND seq = ? AND state = 'running'",
                (state, item.job_id, item.seq),
            ).rowcount
            if moved:
                db.execute(
                    "INSERT INTO batch_results (job_id, position, custom_id, kind, payload,"
                    " error_kind, error_message, attempts, completed_at) VALUES (?, (SELECT"
                    " COALESCE(MAX(position) + 1, 0) FROM batch_results WHERE job_id = ?),"
                    " ?, ?, ?, ?, ?, ?, ?)",
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
            return self._settle(db, item.job_id)

    # -- completion callbacks and retention ---------------------------------------------

    def callbacks_due(self) -> list[Job]:
        """Finished jobs whose completion callback has not been made yet."""
        with self._lock:
            ids = self._db.execute(
                "SELECT id FROM batch_jobs WHERE callback_pending = 1"
            ).fetchall()
            return [self._job(self._db, job_id) for (job_id,) in ids]

    def callback_made(self, job_id: str) -> None:
        with self._transaction() as db:
            db.execute("UPDATE batch_jobs SET callback_pending = 0 WHERE id = ?", (job_id,))

    def expire(self) -> int:
        """Delete finished jobs past their retention, with their items and results."""
        with self._transaction() as db:
            return db.execute(
                "DELETE FROM batch_jobs WHERE expires_at IS NOT NULL AND expires_at <= ?",
                (self._wall_time(),),
            ).rowcount

    # -- internals ---------------------------------------------------------------------

    def _settle(self, db: sqlite3.Connection, job_id: str) -> Job | None:
        """Finish the job if no item is pending or running; returns it if it just finished."""
        (open_items,) = db.execute(
            "SELECT COUNT(*) FROM batch_items WHERE job_id = ? AND state IN ('pending', 'running')",
            (job_id,),
        ).fetchone()
        if open_items:
            return None
        now = self._wall_time()
        finished = db.execute(
            "UPDATE batch_jobs SET status = CASE status WHEN ? THEN ? ELSE ? END,"
            " finished_at = ?, expires_at = ? + retention_s,"
            " callback_pending = (callback_url != '') WHERE id = ? AND status IN (?, ?, ?)",
            (
                JobStatus.CANCELLING.value,
                JobStatus.CANCELLED.value,
                JobStatus.COMPLETED.value,
                now,
                now,
                job_id,
                *_ACTIVE,
                JobStatus.CANCELLING.value,
            ),
        ).rowcount
        return self._job(db, job_id) if finished else None

    def _visible_job(self, db: sqlite3.Connection, tenant: str, job_id: str) -> Job:
        row = db.execute("SELECT tenant, status FROM batch_jobs WHERE id = ?", (job_id,)).fetchone()
        # Another tenant's job reads exactly like a missing one: ids must not leak.
        if row is None or row[0] != tenant or row[1] == JobStatus.UPLOADING.value:
            raise NotFound(f"no batch {job_id!r}")
        return self._job(db, job_id)

    @staticmethod
    def _job(db: sqlite3.Connection, job_id: str) -> Job:
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
        ) = db.execute(f"SELECT {_JOB_COLUMNS} FROM batch_jobs WHERE id = ?", (job_id,)).fetchone()
        by_state = dict(
            db.execute(
                "SELECT state, COUNT(*) FROM batch_items WHERE job_id = ? GROUP BY state",
                (job_id,),
            ).fetchall()
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
