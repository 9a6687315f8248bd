"""The embedded SQLite files (usage ledger, batch jobs): one way to open them.

WAL with synchronous=NORMAL: a commit is in the -wal file when `commit()` returns, so a
killed process (kill -9) loses nothing it committed; only an OS crash may drop the last
commits. FULL would add an fsync per write on the request path for that case alone.
"""

from __future__ import annotations

import sqlite3
from pathlib import Path


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
