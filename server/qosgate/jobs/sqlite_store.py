"""The embedded job store: one SQLite file (WAL), owned by one gateway.

Durability (see `qosgate.database`): a commit survives a kill -9; only an OS crash may
drop the last commits, which then behave like items that were in flight. Statements run
inline on the event loop: they take microseconds on a local file, less than a hop to a
thread would.
"""

from __future__ import annotations

import sqlite3
import threading
from collections.abc import Awaitable, Callable, Sequence
from pathlib import Path
from typing import Any

from qosgate.database import open_database
from qosgate.jobs.model import JobStatus
from qosgate.jobs.store import INDEXES, TABLES, SqlJobStore, SqlSession, T, default_owner

# Columns added after the first release, for files created before them.
_ADDED_COLUMNS = {
    "batch_items": {"lease_token": "TEXT", "lease_expires_at": "REAL"},
    "batch_jobs": {"callback_not_before": "REAL NOT NULL DEFAULT 0"},
}


class _SqliteSession:
    def __init__(self, db: sqlite3.Connection) -> None:
        self._db = db

    async def execute(self, sql: str, args: Sequence[Any] = ()) -> int:
        return self._db.execute(sql, args).rowcount

    async def execute_many(self, sql: str, rows: Sequence[Sequence[Any]]) -> None:
        self._db.executemany(sql, rows)

    async def one(self, sql: str, args: Sequence[Any] = ()) -> tuple[Any, ...] | None:
        row: tuple[Any, ...] | None = self._db.execute(sql, args).fetchone()
        return row

    async def all(self, sql: str, args: Sequence[Any] = ()) -> list[tuple[Any, ...]]:
        return self._db.execute(sql, args).fetchall()


class SqliteJobStore(SqlJobStore):
    """JobStore in a SQLite file; safe to share between threads of one process."""

    def __init__(
        self,
        path: Path | str,
        *,
        wall_time: Callable[[], float],
        lease_s: float = 30.0,
        owner: str | None = None,
    ) -> None:
        """Open (creating or upgrading if needed) the store at `path`; `wall_time` gives
        Unix seconds."""
        super().__init__(wall_time=wall_time, lease_s=lease_s, owner=owner or default_owner())
        self._db = open_database(path, TABLES.format(real="REAL", blob="BLOB"))
        for table, columns in _ADDED_COLUMNS.items():
            present = {row[1] for row in self._db.execute(f"PRAGMA table_info({table})")}
            for column, kind in columns.items():
                if column not in present:
                    self._db.execute(f"ALTER TABLE {table} ADD COLUMN {column} {kind}")
        self._db.executescript(INDEXES)
        self._session = _SqliteSession(self._db)
        self._lock = threading.Lock()

    async def open(self) -> None:
        """Nothing to wait for: the file opened with the store."""

    async def close(self) -> None:
        with self._lock:
            self._db.close()

    async def _write(self, work: Callable[[SqlSession], Awaitable[T]]) -> T:
        # `work` never awaits anything but this session, whose methods finish without
        # suspending: the lock is held across no real await.
        with self._lock:
            self._db.execute("BEGIN IMMEDIATE")
            try:
                result = await work(self._session)
            except BaseException:
                self._db.execute("ROLLBACK")
                raise
            self._db.execute("COMMIT")
            return result

    async def _read(self, work: Callable[[SqlSession], Awaitable[T]]) -> T:
        with self._lock:
            return await work(self._session)

    async def recover(self) -> int:
        """The file is this gateway's alone: whatever a previous run left running or
        half-uploaded died with it, so it is released at once rather than after the lease."""

        async def work(db: SqlSession) -> None:
            await db.execute(
                "DELETE FROM batch_jobs WHERE status = ?", (JobStatus.UPLOADING.value,)
            )
            await db.execute(
                "UPDATE batch_items SET lease_expires_at = 0 WHERE state = 'running'"
            )

        await self._write(work)
        return await super().recover()
