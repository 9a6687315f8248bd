"""The embedded job store: one SQLite file (WAL), owned by one gateway.

Durability (see `qosgate.database`): a commit survives a kill -9; only an OS crash may
drop the last commits, which then behave like items that were in flight. Statements run
inline on the event loop (`SqliteDatabase`).
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from pathlib import Path

from qosgate.database import SqliteDatabase
from qosgate.jobs.model import JobStatus
from qosgate.jobs.store import INDEXES, TABLES, SqlJobStore, SqlSession, T, default_owner

# Columns added after the first release, for files created before them.
_ADDED_COLUMNS = {
    "batch_items": {"lease_token": "TEXT", "lease_expires_at": "REAL"},
    "batch_jobs": {"callback_not_before": "REAL NOT NULL DEFAULT 0"},
}


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
        self._database = SqliteDatabase(path, TABLES.format(real="REAL", blob="BLOB"))
        db = self._database.connection
        for table, columns in _ADDED_COLUMNS.items():
            present = {row[1] for row in db.execute(f"PRAGMA table_info({table})")}
            for column, kind in columns.items():
                if column not in present:
                    db.execute(f"ALTER TABLE {table} ADD COLUMN {column} {kind}")
        db.executescript(INDEXES)

    async def open(self) -> None:
        """Nothing to wait for: the file opened with the store."""

    async def close(self) -> None:
        self._database.close()

    async def _write(self, work: Callable[[SqlSession], Awaitable[T]]) -> T:
        return await self._database.write(work)

    async def _read(self, work: Callable[[SqlSession], Awaitable[T]]) -> T:
        return await self._database.read(work)

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
