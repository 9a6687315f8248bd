"""The shared job store: PostgreSQL, used by every gateway that names the same database.

Any gateway then creates, reads, lists, cancels and streams any job of the tenant, and
items are claimed with leases (`FOR UPDATE SKIP LOCKED`, see `qosgate.jobs.store`), so
the items of a gateway that died are run by the others after the lease.

The connection pool is psycopg's (asyncio): statements never block the event loop. A
database that cannot be reached, or does not answer within `timeout_s`, makes the call
fail with Unavailable; the runner keeps its leases and tries again at its next turn.
Interactive traffic never touches the store, so a gateway starts and serves without it:
the tables are created by the first call that reaches the database.
"""

from __future__ import annotations

import functools
import logging
from collections.abc import Awaitable, Callable, Sequence
from typing import Any

import psycopg
from psycopg import errors as pg_errors
from psycopg_pool import AsyncConnectionPool, PoolTimeout

from qosgate.errors import Unavailable
from qosgate.jobs.store import INDEXES, TABLES, SqlJobStore, SqlSession, T, default_owner

log = logging.getLogger(__name__)

# Two gateways that start together must not both create the tables: the DDL runs under
# this advisory lock (the two-key form, apart from the one-key tenant locks).
_SCHEMA_LOCK = (0x71_6F_73_67, 0x6A_6F_62_73)  # "qosg", "jobs"
# A transaction that lost a deadlock (two gateways renewing and taking over leases of
# the same job at once) is run again this many times.
_ATTEMPTS = 3
_RETRY_AFTER_S = 1.0


@functools.lru_cache(maxsize=256)
def _dialect(sql: str) -> str:
    """The shared statements use `?`; psycopg takes `%s` (no statement has a literal `%`)."""
    return sql.replace("?", "%s")


class _PostgresSession:
    def __init__(self, conn: psycopg.AsyncConnection[Any]) -> None:
        self._conn = conn

    async def execute(self, sql: str, args: Sequence[Any] = ()) -> int:
        cursor = await self._conn.execute(_dialect(sql), args)
        return cursor.rowcount

    async def execute_many(self, sql: str, rows: Sequence[Sequence[Any]]) -> None:
        async with self._conn.cursor() as cursor:
            await cursor.executemany(_dialect(sql), rows)

    async def one(self, sql: str, args: Sequence[Any] = ()) -> tuple[Any, ...] | None:
        cursor = await self._conn.execute(_dialect(sql), args)
        return await cursor.fetchone()

    async def all(self, sql: str, args: Sequence[Any] = ()) -> list[tuple[Any, ...]]:
        cursor = await self._conn.execute(_dialect(sql), args)
        return await cursor.fetchall()


class PostgresJobStore(SqlJobStore):
    """JobStore in PostgreSQL, shared by gateway processes; call `open` before use."""

    LOCK_ROW = " FOR UPDATE"
    SKIP_LOCKED = " FOR UPDATE SKIP LOCKED"

    def __init__(
        self,
        url: str,
        *,
        wall_time: Callable[[], float],
        password: str | None = None,
        pool_size: int = 4,
        timeout_s: float = 5.0,
        lease_s: float = 30.0,
        owner: str | None = None,
    ) -> None:
        """A store on the database at `url` (a libpq URL); nothing connects before `open`."""
        super().__init__(wall_time=wall_time, lease_s=lease_s, owner=owner or default_owner())
        connect: dict[str, Any] = {
            "connect_timeout": max(1, round(timeout_s)),
            # A statement waiting on a lock or a slow server gives up, rather than
            # holding a gateway call for ever.
            "options": f"-c statement_timeout={round(timeout_s * 1000)}",
            "application_name": "qosgate",
        }
        if password is not None:
            connect["password"] = password
        self._pool: AsyncConnectionPool[psycopg.AsyncConnection[Any]] = AsyncConnectionPool(
            url, kwargs=connect, min_size=1, max_size=pool_size, timeout=timeout_s, open=False
        )
        self._tables_ready = False

    async def open(self) -> None:
        """Start connecting and create the tables. A database out of reach is logged, not
        raised: batch calls fail UNAVAILABLE until it answers."""
        await self._pool.open(wait=False)
        try:
            await self._write_tables()
        except Unavailable:
            log.warning("the PostgreSQL job store is out of reach; batch jobs wait for it")

    async def close(self) -> None:
        await self._pool.close()

    async def _lock_tenant(self, db: SqlSession, tenant: str) -> None:
        await db.execute("SELECT pg_advisory_xact_lock(hashtextextended(?, 0))", (tenant,))

    async def _write_tables(self) -> None:
        async def create(db: SqlSession) -> None:
            await db.execute("SELECT pg_advisory_xact_lock(?, ?)", _SCHEMA_LOCK)
            ddl = TABLES.format(real="DOUBLE PRECISION", blob="BYTEA") + INDEXES
            for statement in filter(str.strip, ddl.split(";")):
                await db.execute(statement)

        await self.transact(create)
        self._tables_ready = True

    async def _write(self, work: Callable[[SqlSession], Awaitable[T]]) -> T:
        if not self._tables_ready:
            await self._write_tables()
        return await self.transact(work)

    async def transact(self, work: Callable[[SqlSession], Awaitable[T]]) -> T:
        """Run `work` in one transaction on this store's connections (the OpenAI files'
        store shares them); UNAVAILABLE when the database is out of reach or busy."""
        for attempt in range(1, _ATTEMPTS + 1):
            try:
                async with self._pool.connection() as conn, conn.transaction():
                    return await work(_PostgresSession(conn))
            except (pg_errors.DeadlockDetected, pg_errors.SerializationFailure) as error:
                if attempt == _ATTEMPTS:
                    log.warning("job store transaction failed %d times: %s", attempt, error)
                    raise Unavailable("the batch job store is busy", _RETRY_AFTER_S) from None
            except (PoolTimeout, psycopg.OperationalError) as error:
                log.warning("job store unavailable: %s", error)
                raise Unavailable("the batch job store is unavailable", _RETRY_AFTER_S) from None
        raise AssertionError("unreachable")

    async def _read(self, work: Callable[[SqlSession], Awaitable[T]]) -> T:
        return await self._write(work)
