"""Shared fixtures: free loopback ports, one real tritonserver and one real PostgreSQL
server per test session.

Integration tests start real processes. The Triton fixture loads the models named in
QOSGATE_TEST_MODELS (comma-separated; default: every model in model_repository/ that the
local CPU stack serves), once per session, on ports the OS picked.
"""

from __future__ import annotations

import os
import socket

import pytest

from qosgate.launcher import LocalTriton, TritonPorts

from tests.postgres_server import PostgresServer

DEFAULT_TEST_MODELS = "smollm2,smollm2_trtllm,minilm,identity"


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_models() -> list[str]:
    raw = os.environ.get("QOSGATE_TEST_MODELS", DEFAULT_TEST_MODELS)
    return [m.strip() for m in raw.split(",") if m.strip()]


@pytest.fixture(scope="session")
def triton(tmp_path_factory: pytest.TempPathFactory) -> LocalTriton:
    """A real tritonserver on free loopback ports serving the test models."""
    ports = TritonPorts(grpc=free_port(), http=free_port(), metrics=free_port())
    server = LocalTriton(
        models=test_models(),
        ports=ports,
        log_path=tmp_path_factory.mktemp("triton") / "tritonserver.log",
    )
    with server:
        yield server


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
