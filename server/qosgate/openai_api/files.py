"""What the OpenAI Batch API keeps beside the job store: uploaded files and, per batch,
the OpenAI fields a job does not have (input file, endpoint, window, metadata).

Where the job store is: with the embedded SQLite job store, one SQLite file of its own (WAL,
like the job store: a commit survives a kill -9), so the job store stays the one owner of
jobs, items and results; with the shared PostgreSQL job store, tables of their own in the
same database, over the job store's connections, so a file uploaded through one gateway
replica is read by the others and the Batch API works behind one Service. Output and error
files are not stored at all: they are rendered from the job's results whenever they are
read.
"""

from __future__ import annotations

import abc
import json
import logging
import secrets
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from qosgate.database import SqliteDatabase
from qosgate.errors import InvalidArgument, NotFound, Unavailable
from qosgate.jobs.store import SqlSession, T

if TYPE_CHECKING:
    from qosgate.jobs.postgres_store import PostgresJobStore

log = logging.getLogger(__name__)

_TABLES = """
CREATE TABLE IF NOT EXISTS openai_files (
    id TEXT PRIMARY KEY,
    tenant TEXT NOT NULL,
    purpose TEXT NOT NULL,
    filename TEXT NOT NULL,
    bytes BIGINT NOT NULL,
    created_at {real} NOT NULL,        -- Unix seconds
    content {blob} NOT NULL
);
CREATE TABLE IF NOT EXISTS openai_batches (
    job_id TEXT PRIMARY KEY,           -- the job store's batch id
    tenant TEXT NOT NULL,
    input_file_id TEXT NOT NULL,
    endpoint TEXT NOT NULL,
    completion_window TEXT NOT NULL,
    metadata TEXT NOT NULL,            -- JSON object
    created_at {real} NOT NULL
);
CREATE INDEX IF NOT EXISTS openai_batches_by_tenant ON openai_batches (tenant, created_at, job_id);
CREATE INDEX IF NOT EXISTS openai_files_by_tenant ON openai_files (tenant, created_at, id);
"""
# Replicas starting together must not both create the tables (PostgreSQL): the DDL runs
# under this advisory lock, apart from the job store's.
_SCHEMA_LOCK = (0x71_6F_73_67, 0x66_69_6C_65)  # "qosg", "file"


@dataclass(frozen=True, slots=True)
class StoredFile:
    """An uploaded file's description (its content is read separately)."""

    id: str
    tenant: str
    purpose: str
    filename: str
    bytes: int
    created_at: float


@dataclass(frozen=True, slots=True)
class BatchLink:
    """The OpenAI side of a batch job."""

    job_id: str
    input_file_id: str
    endpoint: str
    completion_window: str
    metadata: dict[str, str]


class FileStore(abc.ABC):
    """Uploaded files and batch links, per tenant; every method is one transaction."""

    def __init__(self, *, wall_time: Callable[[], float]) -> None:
        self._wall_time = wall_time

    @abc.abstractmethod
    async def _write(self, work: Callable[[SqlSession], Awaitable[T]]) -> T:
        """Run `work` in a transaction (committed if it returns, rolled back if it raises)."""

    async def open(self) -> None:
        """Ready the tables (the SQLite file's are, from its opening)."""

    @abc.abstractmethod
    async def close(self) -> None:
        """Release the file or connections."""

    async def add_file(
        self, tenant: str, *, purpose: str, filename: str, content: bytes, max_stored_bytes: int
    ) -> StoredFile:
        """Store an upload; InvalidArgument where the tenant's stored files would pass
        `max_stored_bytes` with it (checked in the transaction that inserts it: uploads
        racing on two PostgreSQL replicas may each pass it by their own size)."""
        stored = StoredFile(
            f"file-{secrets.token_hex(12)}", tenant, purpose, filename, len(content), self._wall_time()
        )

        async def work(db: SqlSession) -> None:
            row = await db.one("SELECT COALESCE(SUM(bytes), 0) FROM openai_files WHERE tenant = ?", (tenant,))
            kept = int(row[0]) if row is not None else 0
            if kept + stored.bytes > max_stored_bytes:
                raise InvalidArgument(
                    f"storage limit: the tenant's files take {kept} bytes, and this one's {stored.bytes} would pass"
                    f" max_stored_bytes {max_stored_bytes}; delete files first (DELETE /v1/files/{{id}})"
                )
            await db.execute(
                "INSERT INTO openai_files (id, tenant, purpose, filename, bytes, created_at, content)"
                " VALUES (?, ?, ?, ?, ?, ?, ?)",
                (stored.id, tenant, purpose, filename, stored.bytes, stored.created_at, content),
            )

        await self._write(work)
        return stored

    async def get_file(self, tenant: str, file_id: str) -> StoredFile:
        """Raises NotFound for another tenant's file as for a missing one."""

        async def work(db: SqlSession) -> tuple[Any, ...] | None:
            return await db.one(
                "SELECT id, tenant, purpose, filename, bytes, created_at FROM openai_files"
                " WHERE id = ? AND tenant = ?",
                (file_id, tenant),
            )

        row = await self._write(work)
        if row is None:
            raise NotFound(f"no file {file_id!r}")
        return StoredFile(*row)

    async def content(self, tenant: str, file_id: str) -> bytes:
        async def work(db: SqlSession) -> tuple[Any, ...] | None:
            return await db.one("SELECT content FROM openai_files WHERE id = ? AND tenant = ?", (file_id, tenant))

        row = await self._write(work)
        if row is None:
            raise NotFound(f"no file {file_id!r}")
        return bytes(row[0])

    async def list_files(
        self, tenant: str, *, purpose: str | None, limit: int, after_id: str | None, ascending: bool
    ) -> list[StoredFile]:
        """The tenant's uploaded files (of `purpose`, if given), newest first unless
        `ascending`, after `after_id` (a cursor: a file of the tenant's) if given."""
        query = "SELECT id, tenant, purpose, filename, bytes, created_at FROM openai_files WHERE tenant = ?"
        args: list[object] = [tenant]
        if purpose is not None:
            query += " AND purpose = ?"
            args.append(purpose)
        direction, beyond = ("ASC", ">") if ascending else ("DESC", "<")
        if after_id is not None:
            query += (
                f" AND (created_at, id) {beyond} (SELECT created_at, id FROM openai_files"
                " WHERE id = ? AND tenant = ?)"
            )
            args += [after_id, tenant]
        query += f" ORDER BY created_at {direction}, id {direction} LIMIT ?"
        args.append(limit)

        async def work(db: SqlSession) -> list[tuple[Any, ...]]:
            return await db.all(query, args)

        return [StoredFile(*row) for row in await self._write(work)]

    async def delete_file(self, tenant: str, file_id: str) -> None:
        """Delete an uploaded file and its content; NotFound for another tenant's file as
        for a missing one. Batches made from it keep their items (copied at creation)."""

        async def work(db: SqlSession) -> tuple[Any, ...] | None:
            return await db.one("DELETE FROM openai_files WHERE id = ? AND tenant = ? RETURNING id", (file_id, tenant))

        if await self._write(work) is None:
            raise NotFound(f"no file {file_id!r}")

    async def link_batch(self, tenant: str, link: BatchLink) -> None:
        async def work(db: SqlSession) -> None:
            await db.execute(
                "INSERT INTO openai_batches (job_id, tenant, input_file_id, endpoint,"
                " completion_window, metadata, created_at) VALUES (?, ?, ?, ?, ?, ?, ?)",
                (
                    link.job_id,
                    tenant,
                    link.input_file_id,
                    link.endpoint,
                    link.completion_window,
                    json.dumps(link.metadata),
                    self._wall_time(),
                ),
            )

        await self._write(work)

    async def unlink_batch(self, job_id: str) -> None:
        async def work(db: SqlSession) -> None:
            await db.execute("DELETE FROM openai_batches WHERE job_id = ?", (job_id,))

        await self._write(work)

    async def batch_link(self, tenant: str, job_id: str) -> BatchLink:
        """Raises NotFound for a batch not created through the OpenAI API (or not the tenant's)."""

        async def work(db: SqlSession) -> tuple[Any, ...] | None:
            return await db.one(
                "SELECT job_id, input_file_id, endpoint, completion_window, metadata"
                " FROM openai_batches WHERE job_id = ? AND tenant = ?",
                (job_id, tenant),
            )

        row = await self._write(work)
        if row is None:
            raise NotFound(f"no batch {job_id!r}")
        return _link(row)

    async def batch_links(self, tenant: str, *, limit: int, after_id: str | None) -> list[BatchLink]:
        """The tenant's batches, newest first, after `after_id` (a cursor) if given."""
        query = (
            "SELECT job_id, input_file_id, endpoint, completion_window, metadata FROM openai_batches"
            " WHERE tenant = ?"
        )
        args: list[object] = [tenant]
        if after_id is not None:
            query += (
                " AND (created_at, job_id) < (SELECT created_at, job_id FROM openai_batches"
                " WHERE job_id = ? AND tenant = ?)"
            )
            args += [after_id, tenant]
        query += " ORDER BY created_at DESC, job_id DESC LIMIT ?"
        args.append(limit)

        async def work(db: SqlSession) -> list[tuple[Any, ...]]:
            return await db.all(query, args)

        return [_link(row) for row in await self._write(work)]


class SqliteFileStore(FileStore):
    """The files in a SQLite file of their own, beside the SQLite job store."""

    def __init__(self, path: Path | str, *, wall_time: Callable[[], float]) -> None:
        super().__init__(wall_time=wall_time)
        self._database = SqliteDatabase(path, _TABLES.format(real="REAL", blob="BLOB"))

    async def _write(self, work: Callable[[SqlSession], Awaitable[T]]) -> T:
        return await self._database.write(work)

    async def close(self) -> None:
        self._database.close()


class PostgresFileStore(FileStore):
    """The files in the shared job store's PostgreSQL database, over its connections. As
    with the job store, a database out of reach fails these calls UNAVAILABLE, and the
    tables are made by the first call that reaches it."""

    def __init__(self, jobs: PostgresJobStore, *, wall_time: Callable[[], float]) -> None:
        super().__init__(wall_time=wall_time)
        self._jobs = jobs
        self._tables_ready = False

    async def open(self) -> None:
        try:
            await self._create_tables()
        except Unavailable:
            log.warning("the PostgreSQL job store is out of reach; the OpenAI files wait for it")

    async def close(self) -> None:
        """The connections are the job store's: it closes them."""

    async def _create_tables(self) -> None:
        async def create(db: SqlSession) -> None:
            await db.execute("SELECT pg_advisory_xact_lock(?, ?)", _SCHEMA_LOCK)
            for statement in filter(str.strip, _TABLES.format(real="DOUBLE PRECISION", blob="BYTEA").split(";")):
                await db.execute(statement)

        await self._jobs.transact(create)
        self._tables_ready = True

    async def _write(self, work: Callable[[SqlSession], Awaitable[T]]) -> T:
        if not self._tables_ready:
            await self._create_tables()
        return await self._jobs.transact(work)


def _link(row: tuple[Any, ...]) -> BatchLink:
    job_id, input_file_id, endpoint, window, metadata = (str(column) for column in row)
    return BatchLink(job_id, input_file_id, endpoint, window, json.loads(metadata))
