"""A throwaway PostgreSQL server for tests: Debian's `postgresql` binaries, a temporary
data directory, a free loopback port, trust authentication for the user `qos`.

The server refuses to run as root, so under root it runs as the `postgres` user the
package creates, on a directory that user owns. fsync is off: the data dies with the test.
"""

from __future__ import annotations

import glob
import os
import secrets
import shutil
import subprocess
import tempfile
from pathlib import Path

import psycopg

USER = "qos"
_BIN_GLOB = "/usr/lib/postgresql/*/bin"


def server_bindir() -> Path:
    """The newest installed server's bin directory; a clear failure when there is none."""
    found = sorted(
        (Path(p) for p in glob.glob(_BIN_GLOB) if (Path(p) / "pg_ctl").exists()),
        key=lambda p: int(p.parent.name),
    )
    if not found:
        raise RuntimeError(
            f"PostgreSQL server binaries not found ({_BIN_GLOB}/pg_ctl): install Debian's"
            " `postgresql` package (apt-get install -y postgresql; make's system deps do)"
        )
    return found[-1]


class PostgresServer:
    """Start with `start()`, stop with `stop()`; `database()` makes a fresh empty one."""

    def __init__(self, port: int) -> None:
        self.port = port
        self._bin = server_bindir()
        self._dir = Path(tempfile.mkdtemp(prefix="qosgate-pg-"))
        self._as_postgres = os.geteuid() == 0
        if self._as_postgres:
            shutil.chown(self._dir, "postgres", "postgres")

    def _run(self, *args: str) -> None:
        command = [str(self._bin / args[0]), *args[1:]]
        if self._as_postgres:
            command = ["runuser", "-u", "postgres", "--", *command]
        done = subprocess.run(command, capture_output=True, text=True, timeout=120, check=False)
        if done.returncode != 0:
            log = self._dir / "log"
            tail = log.read_text(errors="replace")[-2000:] if log.exists() else ""
            raise RuntimeError(f"{' '.join(args[:2])} failed: {done.stderr}{done.stdout}\n{tail}")

    def start(self) -> PostgresServer:
        data = str(self._dir / "data")
        self._run("initdb", "-D", data, "-A", "trust", "-U", USER, "--no-sync")
        options = (
            f"-p {self.port} -k {self._dir} -c listen_addresses=127.0.0.1 -c fsync=off"
            " -c max_connections=200"
        )
        self._run("pg_ctl", "-D", data, "-o", options, "-l", str(self._dir / "log"), "-w", "start")
        return self

    def stop(self) -> None:
        try:
            self._run("pg_ctl", "-D", str(self._dir / "data"), "-m", "fast", "-w", "stop")
        finally:
            shutil.rmtree(self._dir, ignore_errors=True)

    def url(self, database: str = "postgres") -> str:
        return f"postgresql://{USER}@127.0.0.1:{self.port}/{database}"

    def database(self) -> str:
        """A new empty database; returns its URL."""
        name = f"t_{secrets.token_hex(6)}"
        with psycopg.connect(self.url(), autocommit=True) as conn:
            conn.execute(f"CREATE DATABASE {name}")
        return self.url(name)
