"""SIGHUP reloads the tenants of a running `qosgate serve`: keys rotate, limits change, and
a broken file is refused while the gateway keeps serving on what it had."""

from __future__ import annotations

import signal
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import grpc
import pytest
import yaml
from conftest import free_port
from gateway_harness import GatewayProcess
from qosgate.launcher import LocalTriton
from tritonclient.grpc import service_pb2, service_pb2_grpc

pytestmark = pytest.mark.integration

OLD_KEY = "reload-old-key"
NEW_KEY = "reload-new-key"


@pytest.fixture
def config(triton: LocalTriton, tmp_path: Path) -> dict[str, Any]:
    return {
        "listen": f"127.0.0.1:{free_port()}",
        "metrics_listen": "127.0.0.1:0",
        "openai": {"listen": "127.0.0.1:0", "files_db": str(tmp_path / "openai_files.sqlite3")},
        "upstreams": [{"name": "local", "url": triton.ports.grpc_url}],
        "usage_db": str(tmp_path / "usage.sqlite3"),
        "batch": {"db": str(tmp_path / "batch.sqlite3")},
        "tenants": [{"name": "acme", "api_keys": [{"key": OLD_KEY}]}],
    }


@pytest.fixture
def gateway(config: dict[str, Any], tmp_path: Path) -> Iterator[GatewayProcess]:
    with GatewayProcess.running(config, tmp_path) as process:
        yield process


def code_of(call: Callable[..., Any], request: Any, key: str) -> grpc.StatusCode:
    try:
        call(request, metadata=(("x-api-key", key),), timeout=10)
    except grpc.RpcError as e:
        return e.code()
    return grpc.StatusCode.OK


def hangup_and_wait(gateway: GatewayProcess, log_line: str) -> str:
    """SIGHUP the gateway and return its log once `log_line` appears in what it adds."""
    seen = len(gateway.log_text())
    assert gateway.proc is not None
    gateway.proc.send_signal(signal.SIGHUP)
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        added = gateway.log_text()[seen:]
        if log_line in added:
            return added
        time.sleep(0.1)
    raise AssertionError(f"no {log_line!r} after SIGHUP: {gateway.log_text()[-2000:]}")


def test_sighup_rotates_keys_and_limits_and_survives_a_broken_file(
    gateway: GatewayProcess, config: dict[str, Any]
) -> None:
    with grpc.insecure_channel(gateway.target) as channel:
        stub = service_pb2_grpc.GRPCInferenceServiceStub(channel)

        def live(key: str) -> grpc.StatusCode:
            return code_of(stub.ServerLive, service_pb2.ServerLiveRequest(), key)

        assert live(OLD_KEY) is grpc.StatusCode.OK
        assert live(NEW_KEY) is grpc.StatusCode.UNAUTHENTICATED
        # The relay remembers what a key identified on a connection: this one, reused below.
        request = service_pb2.ModelInferRequest(model_name="no_such_model")
        assert code_of(stub.ModelInfer, request, OLD_KEY) not in (
            grpc.StatusCode.UNAUTHENTICATED, grpc.StatusCode.RESOURCE_EXHAUSTED
        )

        # Rotate the key, and hold the tenant to one request per 100 s; change a key that
        # only a restart applies.
        gateway.config_path.write_text(
            yaml.safe_dump(
                {
                    **config,
                    "scheduler": {"max_queue_length": 10},
                    "tenants": [
                        {
                            "name": "acme",
                            "api_keys": [{"key": NEW_KEY}],
                            "limits": {"requests_per_second": 0.01, "burst": 1},
                        }
                    ],
                }
            )
        )
        added = hangup_and_wait(gateway, "config reloaded")
        assert "not applied until a restart: scheduler" in added
        assert live(OLD_KEY) is grpc.StatusCode.UNAUTHENTICATED
        assert code_of(stub.ModelInfer, request, OLD_KEY) is grpc.StatusCode.UNAUTHENTICATED
        assert live(NEW_KEY) is grpc.StatusCode.OK  # ServerLive is not rate-limited
        assert NEW_KEY not in gateway.log_text() and OLD_KEY not in gateway.log_text()

        # Inference is: the burst of one goes through (to Triton, which has no such model),
        # the next request is refused by the new limit.
        codes = [code_of(stub.ModelInfer, request, NEW_KEY) for _ in range(2)]
        assert codes[0] is not grpc.StatusCode.RESOURCE_EXHAUSTED, codes
        assert codes[1] is grpc.StatusCode.RESOURCE_EXHAUSTED, codes

        # A broken file changes nothing: the new key keeps working.
        gateway.config_path.write_text("tenants: [\n")
        added = hangup_and_wait(gateway, "config reload failed")
        assert "invalid YAML" in added
        assert live(NEW_KEY) is grpc.StatusCode.OK
        assert gateway.proc is not None and gateway.proc.poll() is None
