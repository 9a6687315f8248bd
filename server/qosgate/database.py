"""The embedded SQLite files (usage ledger, batch jobs, OpenAI files): one way to open them,
and one way to run transactions on them from the event loop.

WAL with synchronous=NORMAL: a commit is in the -wal file when `commit()` returns, so a
killed process (kill -9) loses nothing it committed; only an OS crash may drop the last
commits. FULL would add an fsync per write on the request path for that case alone.
"""

from __future__ import annotations

import sqlite3
import threading
from collections.abc import Awaitable, Callable, Sequence
from pathlib import Path
from typing import Any, TypeVar

T = TypeVar("T")


def open_database(path: Path | str, schema: str) -> sqlite3.Connection:
    """Open (creating it and its directory if needed) the SQLite file at `path` in
    autocommit mode, usable from any thread (callers serialize access with a lock), and
    apply `schema` (idempotent DDL)."""
    if str(path) != ":memory:":
        Path(path).parent.mkdir(parents=True, exist_ok=True)
    db = sqlite3.connect(str(path), check_same_thread=False, isolation_level=None)
    db.execute("PRAGMA journal_mode=WAL")
    db.execute("PRAGMA synchronous=NORMAL")
    db.execute("PRAGMA foreign_keys=ON")
    db.executescript(schema)
    return db


class SqliteSession:
    """A `qosgate.jobs.store.SqlSession` on one connection: its statements finish without
    suspending (microseconds on a local file, less than a hop to a thread would cost)."""

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


class SqliteDatabase:
    """One SQLite file (`open_database`), its transactions serialized by a lock: safe to
    share between the threads of one process."""

    def __init__(self, path: Path | str, schema: str) -> None:
        self.connection = open_database(path, schema)
        self._session = SqliteSession(self.connection)
        self._lock = threading.Lock()

    async def write(self, work: Callable[[SqliteSession], Awaitable[T]]) -> T:
        """Run `work` in a write transaction (committed if it returns, rolled back if it
        raises). `work` awaits nothing but the session, whose methods finish without
        suspending: the lock is held across no real await."""
        with self._lock:
            self.connection.execute("BEGIN IMMEDIATE")
            try:
                result = await work(self._session)
            except BaseException:
                self.connection.execute("ROLLBACK")
                raise
            self.connection.execute("COMMIT")
            return result

    async def read(self, work: Callable[[SqliteSession], Awaitable[T]]) -> T:
        with self._lock:
            return await work(self._session)

    def close(self) -> None:
        with self._lock:
            self.connection.close()
