"""Gateways for integration tests.

`GatewayThread`: an in-process gateway on port 0, on its own event loop thread. Its own
loop lets tests call it with blocking clients (tritonclient's sync API, perf_analyzer) as
well as from asyncio tests, without either side starving the other.

`GatewayProcess`: `qosgate serve` as a real process, for tests that signal it (kill -9,
SIGTERM, SIGHUP).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import pathlib
import signal
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Coroutine, Iterator
from typing import Any, TypeVar

import grpc
import numpy as np
import yaml
from grpc_health.v1 import health_pb2, health_pb2_grpc
from tritonclient.grpc import service_pb2
from qosgate.app import Gateway
from qosgate.config import GatewayConfig, parse_config

T = TypeVar("T")

ACME_KEY = "test-acme-key"
GLOBEX_KEY = "test-globex-key"
ADMIN_KEY = "test-admin-key"
TINY_KEY = "test-tiny-key"


def bearer(key: str) -> dict[str, str]:
    return {"authorization": f"Bearer {key}"}


def identity_request(request_id: str = "") -> service_pb2.ModelInferRequest:
    """A valid ModelInferRequest for the identity model (one row of two floats)."""
    request = service_pb2.ModelInferRequest(model_name="identity", id=request_id)
    request.inputs.add(name="INPUT0", datatype="FP32", shape=[1, 2])
    request.raw_input_contents.append(np.array([1.0, 2.0], dtype=np.float32).tobytes())
    return request


def gateway_config(upstream_url: str, **overrides: Any) -> GatewayConfig:
    """Tenants for the tests: acme (all models, up to critical), globex (identity only, up to
    interactive), ops (admin), tiny (one request per 10 s)."""
    raw: dict[str, Any] = {
        "listen": "127.0.0.1:0",
        "metrics_listen": "127.0.0.1:0",
        "openai": {"listen": "127.0.0.1:0"},
        "upstreams": [{"name": "local", "url": upstream_url}],
        "tenants": [
            {
                "name": "acme",
                "api_keys": [{"key": ACME_KEY}],
                "weight": 2,
                "default_class": "interactive",
                "max_class": "critical",
            },
            {
                "name": "globex",
                "api_keys": [{"key": GLOBEX_KEY}],
                "default_class": "standard",
                "max_class": "interactive",
                "models": ["identity"],
            },
            {"name": "ops", "admin": True, "api_keys": [{"key": ADMIN_KEY}]},
            {
                "name": "tiny",
                "api_keys": [{"key": TINY_KEY}],
                "limits": {"requests_per_second": 0.1, "burst": 1},
            },
        ],
    }
    raw.update(overrides)
    return parse_config(raw, source="<test config>")


class TracebackCollector(logging.Handler):
    """Collects the gateway's log records that carry a traceback (it runs in this process).

    Only the loggers named by `prefixes` count, by default the gateway's own and grpc's (a
    servicer's unhandled error): in a full test run, grpc.aio's shared poller may still
    report to an event loop that an earlier test module closed, logged under `asyncio`,
    which says nothing of the gateway.
    """

    def __init__(self, prefixes: tuple[str, ...] = ("qosgate", "grpc")) -> None:
        super().__init__(logging.WARNING)
        self.prefixes = prefixes
        self.records: list[logging.LogRecord] = []

    def emit(self, record: logging.LogRecord) -> None:
        if record.name.startswith(self.prefixes) and (record.exc_info or record.exc_text):
            self.records.append(record)


class GatewayThread:
    """A started Gateway whose event loop runs in a daemon thread."""

    def __init__(self, config: GatewayConfig, *, health_check_interval_s: float = 0.2) -> None:
        # State (SQLite files, the private socket) the test did not place goes to a private
        # directory: never the shared .cache, which parallel test runs would share.
        self._state = tempfile.TemporaryDirectory(prefix="qosgate-gateway-")
        if config.state_dir is None:
            config = config.model_copy(update={"state_dir": self._state.name})
        self.loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self.loop.run_forever, name="gateway", daemon=True)
        self.gateway = Gateway(config, health_check_interval_s=health_check_interval_s)

    def start(self) -> GatewayThread:
        self._thread.start()
        self.run(self.gateway.start())
        return self

    def run(self, coro: Coroutine[Any, Any, T], timeout: float = 30.0) -> T:
        """Run a coroutine on the gateway's loop and wait for its result."""
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(timeout)

    @property
    def url(self) -> str:
        return f"127.0.0.1:{self.gateway.port}"

    def wait_ready(self, timeout: float = 30.0) -> GatewayThread:
        """Wait until the gateway sees a ready upstream."""
        deadline = time.monotonic() + timeout
        while not self.gateway.pool.live:
            assert time.monotonic() < deadline, "gateway never saw a ready upstream"
            time.sleep(0.1)
        return self

    @property
    def openai_url(self) -> str:
        """Base URL of the OpenAI API, as the SDKs take it."""
        return f"http://127.0.0.1:{self.gateway.http_port}/v1"

    def stop(self) -> None:
        try:
            self.run(self.gateway.stop(grace_s=1.0))
        except TimeoutError:
            # A stop that never returns is a bug of its own: say what it waits on.
            raise AssertionError(f"the gateway's stop did not return; its tasks:\n{self.run(_tasks(), 5.0)}") from None
        finally:
            self.loop.call_soon_threadsafe(self.loop.stop)
            self._thread.join(timeout=10)
            self.loop.close()
            self._state.cleanup()

    def __enter__(self) -> GatewayThread:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()


async def _tasks() -> str:
    """Every other task of the running loop, with where it waits."""
    lines = []
    for task in asyncio.all_tasks():
        if task is not asyncio.current_task():
            frames = task.get_stack()
            where = f"{frames[-1].f_code.co_filename}:{frames[-1].f_lineno}" if frames else "?"
            lines.append(f"{task.get_name()}: {task.get_coro()!r} at {where}")
    return "\n".join(lines)


class GatewayProcess:
    """`qosgate serve --config FILE` in its own process, listening where the file says.

    Restartable: `start` again after `kill`/`stop` runs the same file (so the same state
    files) anew. The process's output goes to `log_path`, appended across restarts.
    """

    def __init__(
        self, config_path: pathlib.Path, log_path: pathlib.Path, command: list[str] | None = None, **popen: Any
    ) -> None:
        """`command` (default: this interpreter's `qosgate serve --config CONFIG_PATH`) runs
        with `popen`'s further subprocess.Popen arguments (env, user, ...)."""
        self.config_path = config_path
        self.log_path = log_path
        self.command = command or [sys.executable, "-m", "qosgate", "serve", "--config", str(config_path)]
        self._popen = popen
        self.proc: subprocess.Popen[bytes] | None = None

    @classmethod
    @contextlib.contextmanager
    def running(cls, config: dict[str, Any], directory: pathlib.Path) -> Iterator[GatewayProcess]:
        """Write `config` to DIRECTORY/gateway.yaml, start it there, stop it on the way out.
        A config without a `state_dir` keeps its state in DIRECTORY, and one without an
        `openai` section serves it on a free port: no test takes the shared .cache or the
        default port 8080."""
        with cls.side_by_side((config, directory)) as (process,):
            yield process

    @classmethod
    @contextlib.contextmanager
    def side_by_side(cls, *gateways: tuple[dict[str, Any], pathlib.Path]) -> Iterator[list[GatewayProcess]]:
        """`running` for several (config, directory) pairs, started at once (a start is
        mostly the interpreter importing, one core's work) and each waited for."""
        processes = []
        for config, directory in gateways:
            config = {"state_dir": str(directory), **config}
            if "openai" not in config:
                config = {**config, "openai": {"listen": "127.0.0.1:0"}}
            path = directory / "gateway.yaml"
            path.write_text(yaml.safe_dump(config))
            processes.append(cls(path, directory / "gateway.log"))
        try:
            for process in processes:
                process.launch()
            for process in processes:
                process.wait_serving()
            yield processes
        finally:
            for process in processes:
                process.stop()

    @property
    def target(self) -> str:
        return yaml.safe_load(self.config_path.read_text())["listen"]

    def log_text(self) -> str:
        return self.log_path.read_text(errors="replace")

    def start(self, timeout_s: float = 60.0) -> GatewayProcess:
        """Start it and wait until its health service says SERVING."""
        self.launch()
        return self.wait_serving(timeout_s)

    def launch(self) -> None:
        with self.log_path.open("ab") as log:
            self.proc = subprocess.Popen(self.command, stdout=log, stderr=subprocess.STDOUT, **self._popen)

    def wait_serving(self, timeout_s: float = 60.0) -> GatewayProcess:
        assert self.proc is not None
        deadline = time.monotonic() + timeout_s
        with grpc.insecure_channel(self.target) as channel:
            health = health_pb2_grpc.HealthStub(channel)
            while time.monotonic() < deadline:
                if self.proc.poll() is not None:
                    raise RuntimeError(f"gateway exited: {self.log_text()[-3000:]}")
                try:
                    reply = health.Check(health_pb2.HealthCheckRequest(), timeout=1.0)
                    if reply.status == health_pb2.HealthCheckResponse.SERVING:
                        return self
                except grpc.RpcError:
                    pass
                time.sleep(0.2)
        self.stop()  # not left running behind the failed test
        raise TimeoutError(f"gateway not serving: {self.log_text()[-3000:]}")

    def kill(self, sig: int = signal.SIGKILL) -> None:
        """Send `sig` and wait for the process to end."""
        assert self.proc is not None
        os.kill(self.proc.pid, sig)
        self.proc.wait(timeout=30)
        self.proc = None

    def stop(self) -> int | None:
        """End it politely if it still runs (SIGTERM, then SIGKILL after 15 s); its exit
        status, None if it was not running."""
        if self.proc is None:
            return None
        self.proc.send_signal(signal.SIGTERM)
        try:
            status = self.proc.wait(timeout=15)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            status = self.proc.wait()
        self.proc = None
        return status
