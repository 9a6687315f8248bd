"""A throwaway redis-server for tests: Debian's `redis-server`, no persistence, a
directory of its own, a loopback port. `make test` installs it (scripts/system_deps.sh)."""

from __future__ import annotations

import shutil
import subprocess
import time
from pathlib import Path

import redis


class RedisServer:
    """A redis-server on `port` of loopback, its files in `workdir`; `start` again after
    `stop` brings it back on the same port, empty."""

    def __init__(self, workdir: Path, port: int) -> None:
        self.port = port
        self.url = f"redis://127.0.0.1:{self.port}/0"
        self._workdir = workdir
        self._process: subprocess.Popen[bytes] | None = None

    def start(self) -> None:
        assert shutil.which("redis-server"), (
            "redis-server is not installed: `make test` installs it (scripts/system_deps.sh)"
        )
        self._process = subprocess.Popen(
            [
                "redis-server",
                "--port",
                str(self.port),
                "--bind",
                "127.0.0.1",
                "--save",
                "",
                "--appendonly",
                "no",
                "--dir",
                str(self._workdir),
                "--logfile",
                str(self._workdir / "redis.log"),
            ],
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )
        client = redis.Redis(port=self.port, socket_connect_timeout=0.2)
        deadline = time.monotonic() + 10
        try:
            while True:
                try:
                    client.ping()
                    return
                except redis.ConnectionError:
                    if self._process.poll() is not None or time.monotonic() > deadline:
                        raise RuntimeError(
                            f"redis-server did not start; see {self._workdir / 'redis.log'}"
                        ) from None
                    time.sleep(0.05)
        finally:
            client.close()

    def stop(self) -> None:
        if self._process is not None and self._process.poll() is None:
            self._process.terminate()
            self._process.wait(timeout=10)
        self._process = None
