"""What the OpenAI Batch API keeps beside the job store: uploaded files and, per batch,
the OpenAI fields a job does not have (input file, endpoint, window, metadata).

One SQLite file of its own (WAL, like the job store: a commit survives a kill -9), so the
job store stays the one owner of jobs, items and results. Output and error files are not
stored at all: they are rendered from the job's results whenever they are read.
"""

from __future__ import annotations

import json
import secrets
import sqlite3
import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

from qosgate.database import open_database
from qosgate.errors import NotFound

_SCHEMA = """
CREATE TABLE IF NOT EXISTS openai_files (
    id TEXT PRIMARY KEY,
    tenant TEXT NOT NULL,
    purpose TEXT NOT NULL,
    filename TEXT NOT NULL,
    bytes INTEGER NOT NULL,
    created_at REAL NOT NULL,          -- Unix seconds
    content BLOB NOT NULL
);
CREATE TABLE IF NOT EXISTS openai_batches (
    job_id TEXT PRIMARY KEY,           -- the job store's batch id
    tenant TEXT NOT NULL,
    input_file_id TEXT NOT NULL,
    endpoint TEXT NOT NULL,
    completion_window TEXT NOT NULL,
    metadata TEXT NOT NULL,            -- JSON object
    created_at REAL NOT NULL
);
CREATE INDEX IF NOT EXISTS openai_batches_by_tenant ON openai_batches (tenant, created_at, job_id);
"""


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


class FileStore:
    """Uploaded files and batch links, per tenant; every method is one transaction."""

    def __init__(self, path: Path | str, *, wall_time: Callable[[], float]) -> None:
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

    def add_file(self, tenant: str, *, purpose: str, filename: str, content: bytes) -> StoredFile:
        stored = StoredFile(
            f"file-{secrets.token_hex(12)}", tenant, purpose, filename, len(content), self._wall_time()
        )
        with self._transaction() as db:
            db.execute(
                "INSERT INTO openai_files (id, tenant, purpose, filename, bytes, created_at, content)"
                " VALUES (?, ?, ?, ?, ?, ?, ?)",
                (stored.id, tenant, purpose, filename, stored.bytes, stored.created_at, content),
            )
        return stored

    def get_file(self, tenant: str, file_id: str) -> StoredFile:
        """Raises NotFound for another tenant's file as for a missing one."""
        with self._transaction() as db:
            row = db.execute(
                "SELECT id, tenant, purpose, filename, bytes, created_at FROM openai_files"
                " WHERE id = ? AND tenant = ?",
                (file_id, tenant),
            ).fetchone()
        if row is None:
            raise NotFound(f"no file {file_id!r}")
        return StoredFile(*row)

    def content(self, tenant: str, file_id: str) -> bytes:
        with self._transaction() as db:
            row = db.execute(
                "SELECT content FROM openai_files WHERE id = ? AND tenant = ?", (file_id, tenant)
            ).fetchone()
        if row is None:
            raise NotFound(f"no file {file_id!r}")
        return bytes(row[0])

    def link_batch(self, tenant: str, link: BatchLink) -> None:
        with self._transaction() as db:
            db.execute(
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

    def unlink_batch(self, job_id: str) -> None:
        with self._transaction() as db:
            db.execute("DELETE FROM openai_batches WHERE job_id = ?", (job_id,))

    def batch_link(self, tenant: str, job_id: str) -> BatchLink:
        """Raises NotFound for a batch not created through the OpenAI API (or not the tenant's)."""
        with self._transaction() as db:
            row = db.execute(
                "SELECT job_id, input_file_id, endpoint, completion_window, metadata"
                " FROM openai_batches WHERE job_id = ? AND tenant = ?",
                (job_id, tenant),
            ).fetchone()
        if row is None:
            raise NotFound(f"no batch {job_id!r}")
        return _link(row)

    def batch_links(self, tenant: str, *, limit: int, after_id: str | None) -> list[BatchLink]:
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
        with self._transaction() as db:
            rows = db.execute(query, args).fetchall()
        return [_link(row) for row in rows]


def _link(row: tuple[str, str, str, str, str]) -> BatchLink:
    job_id, input_file_id, endpoint, window, metadata = row
    return BatchLink(job_id, input_file_id, endpoint, window, json.loads(metadata))
