"""Shared fixtures: free loopback ports, one real tritonserver and one real PostgreSQL
server per test session.

Integration tests start real processes. The Triton fixture loads the models named in
QOSGATE_TEST_MODELS (comma-separated; default: every model in model_repository/ that the
local CPU stack serves), once per session, on free ports (see `free_port`).
"""

from __future__ import annotations

import ast
import contextlib
import os
import pathlib
import random
import signal
import socket
import threading
import time
import urllib.request
import warnings
from collections.abc import Iterator
from typing import Any

import pytest

from qosgate.launcher import LOCAL_MODELS, LocalTriton, TritonPorts, TritonStartTimeout

from tests.postgres_server import PostgresServer
from tests.redis_server import RedisServer

# CPython 3.11 keeps one AST-building depth counter per interpreter (python/cpython#106905):
# two threads parsing at once, when a garbage collection in one runs Python finalizers and
# the other gets the GIL, fail with "SystemError: AST constructor recursion depth mismatch".
# Tests run gateways in threads of this process, and both pytest (rendering a failure) and
# `traceback` (a gateway thread logging an exception: its carets parse source) parse with
# `ast.parse`; one such collision turned a test failure into a pytest INTERNALERROR that
# hid which test failed and why. So one thread parses at a time.
_ast_parse = ast.parse
_ast_lock = threading.RLock()


def _parse_alone(*args: Any, **kwargs: Any) -> Any:
    with _ast_lock:
        return _ast_parse(*args, **kwargs)


ast.parse = _parse_alone  # type: ignore[assignment]

DEFAULT_TEST_MODELS = ",".join(LOCAL_MODELS)


# Ports for the servers tests start come from below the kernel's ephemeral range: a port
# that bind(0) picked is free again once checked, and another process's bind(0) (vLLM's
# engine starting inside the first of two Tritons, a client's socket) could take it
# before the server it was picked for binds it ("Socket ... already in use").
LOWEST_PORT = 20000
_handed_out: set[int] = set()


def _first_ephemeral_port() -> int:
    try:
        with open("/proc/sys/net/ipv4/ip_local_port_range") as ports:
            return int(ports.read().split()[0])
    except (OSError, ValueError, IndexError):
        return 32768  # Linux's default


def free_port() -> int:
    """A loopback port that is free now, outside the ephemeral range, and not handed out
    before in this session."""
    candidates = [p for p in range(LOWEST_PORT, _first_ephemeral_port()) if p not in _handed_out]
    for port in random.sample(candidates, min(len(candidates), 200)):
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
            try:
                s.bind(("127.0.0.1", port))
            except OSError:
                continue
        _handed_out.add(port)
        return port
    raise RuntimeError(f"no free loopback port between {LOWEST_PORT} and the ephemeral range")


def test_models() -> list[str]:
    raw = os.environ.get("QOSGATE_TEST_MODELS", DEFAULT_TEST_MODELS)
    return [m.strip() for m in raw.split(",") if m.strip()]


# The session's tritonserver, started as soon as the tests are collected (see below).
_session_triton: list[LocalTriton] = []


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """The modules that never use the session's tritonserver (they start servers of their
    own, or none) run right after the unit tests, in their usual order: its start-up then
    runs beside them too, instead of holding up the first test that needs it. A module's
    tests stay together, so its module-scoped fixtures start once."""
    users = {getattr(item, "module", None) for item in items if "triton" in getattr(item, "fixturenames", ())}
    items.sort(key=lambda item: getattr(item, "module", None) in users)


def pytest_collection_finish(session: pytest.Session) -> None:
    """Start the session's tritonserver once the tests are collected, if any of them uses
    it: its start-up (30-50 s, vLLM's engine the most of it) then runs beside the unit
    tests, which run first (`testpaths`), and the modules that do not use it (above),
    instead of holding up the first test that needs it. The `triton` fixture waits for it
    to be ready."""
    if session.config.option.collectonly:
        return
    if not any("triton" in getattr(item, "fixturenames", ()) for item in session.items):
        return
    ports = TritonPorts(grpc=free_port(), http=free_port(), metrics=free_port())
    # The fixture's own temporary directory (pytest's basetemp), where tmp_path_factory puts it.
    log_dir = session.config._tmp_path_factory.mktemp("triton")  # noqa: SLF001
    server = LocalTriton(models=test_models(), ports=ports, log_path=log_dir / "tritonserver.log")
    server.start()
    _session_triton.append(server)


def pytest_sessionfinish(session: pytest.Session) -> None:
    # Where no test got to use it (all deselected by a failure with -x, an interrupt).
    for server in _session_triton:
        kill_triton(server)


@pytest.fixture(scope="session")
def triton() -> Iterator[LocalTriton]:
    """A real tritonserver on free loopback ports serving the test models."""
    (server,) = _session_triton
    with ready_then_killed(server):
        yield server


def shared_memory_of(pgid: int) -> set[pathlib.Path]:
    """The files in /dev/shm that the processes of group `pgid` have mapped (Triton's
    python stubs' regions, vLLM's queues)."""
    found = set()
    for proc in pathlib.Path("/proc").iterdir():
        try:
            if not proc.name.isdigit() or os.getpgid(int(proc.name)) != pgid:
                continue
            maps = (proc / "maps").read_text()
        except OSError:  # gone meanwhile, or not ours to read
            continue
        for line in maps.splitlines():
            fields = line.split(maxsplit=5)
            if len(fields) == 6 and fields[5].startswith("/dev/shm/") and not fields[5].endswith(" (deleted)"):
                found.add(pathlib.Path(fields[5]))
    return found


def kill_triton(server: LocalTriton) -> None:
    """kill -9 to the server's whole process group, then remove the shared memory its
    processes had mapped (a killed Triton leaves it in /dev/shm)."""
    if server.pid is None:
        return
    mapped = shared_memory_of(server.pid)
    os.killpg(server.pid, signal.SIGKILL)
    server.stop()  # reaps it; nothing of the group is left to signal
    for path in mapped:
        path.unlink(missing_ok=True)


# A tritonserver with smollm2 is ready 25-60 s after its start here. Once (in a clean run's
# fourth vLLM start), Triton 2.51 never finished loading it: its log ended at our backend's
# "vllm backend: ... ready", the stub waited for work, and no "successfully loaded" came in
# 300 s. A wait this long is taken for that hang: the server is started again.
START_HANG_S = 150.0


def wait_ready(server: LocalTriton) -> None:
    """`server.wait_ready()`, started once more if Triton hangs in its start (above); a
    server that exits, or hangs twice, fails the test with its log tail."""
    try:
        server.wait_ready(timeout=START_HANG_S)
    except TritonStartTimeout as e:
        warnings.warn(f"tritonserver hung in its start, starting it again: {e}", stacklevel=2)
        server.start()
        server.wait_ready()


@contextlib.contextmanager
def ready_then_killed(server: LocalTriton) -> Iterator[LocalTriton]:
    """A started tritonserver whose stop is not what the test checks (test_smollm2's last
    test checks that): ready on entry, killed on the way out. A polite stop waits out
    Triton's exit timeout and vLLM's engine shutdown, 5-25 s a server."""
    try:
        wait_ready(server)
        yield server
    finally:
        kill_triton(server)


def started_then_killed(server: LocalTriton) -> contextlib.AbstractContextManager[LocalTriton]:
    """`with server:` for a test's own tritonserver, killed on the way out (ready_then_killed)."""
    server.start()
    return ready_then_killed(server)


def require_model(name: str) -> None:
    """Skip a test whose model this session's Triton was not asked to load."""
    if name not in test_models():
        pytest.skip(f"model {name!r} not in QOSGATE_TEST_MODELS")


@pytest.fixture(scope="session")
def postgres() -> PostgresServer:
    """A real PostgreSQL server on a free loopback port; `postgres.database()` gives each
    test its own empty database."""
    server = PostgresServer(free_port()).start()
    try:
        yield server
    finally:
        server.stop()


@pytest.fixture(scope="module")
def redis_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RedisServer]:
    """A real redis-server on a free loopback port (tests keep apart by key prefix)."""
    server = RedisServer(tmp_path_factory.mktemp("redis"), free_port())
    server.start()
    yield server
    server.stop()


def engine_gauges(triton: LocalTriton) -> dict[str, float]:
    """The vLLM backend's engine metrics from Triton's metrics endpoint, by name."""
    url = f"http://127.0.0.1:{triton.ports.metrics}/metrics"
    text = urllib.request.urlopen(url, timeout=5).read().decode()
    values: dict[str, float] = {}
    for line in text.splitlines():
        if line.startswith("vllm_engine_"):
            name = line.split("{", 1)[0]
            values[name] = values.get(name, 0.0) + float(line.rsplit(" ", 1)[1])
    return values


def engine_idle(triton: LocalTriton, why: str, timeout: float = 30.0) -> dict[str, float]:
    """Wait until the engine runs no request; returns its metrics then."""
    # The backend polls for cancellation; a loaded shared machine can take a while.
    deadline = time.monotonic() + timeout
    while (gauges := engine_gauges(triton))["vllm_engine_requests_running"] > 0:
        assert time.monotonic() < deadline, why
        time.sleep(0.2)
    return gauges
