"""The error table through the real gateway and a real gRPC channel, details decoded as a
client would (grpcio-status reading `grpc-status-details-bin`).

Rows that need a queue (deadline, shedding, cancellation) hold the model's dispatch window
from inside the gateway, so the outcome does not depend on how fast this machine is.
"""

from __future__ import annotations

import asyncio
import contextlib
import threading
import time
from collections.abc import Iterator

import grpc
import pytest
from google.rpc import error_details_pb2
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_status import rpc_status
from tritonclient.grpc import service_pb2, service_pb2_grpc

from conftest import free_port, require_model
from gateway_harness import ACME_KEY, GLOBEX_KEY, TINY_KEY, GatewayThread, gateway_config, identity_request

pytestmark = pytest.mark.integration


@pytest.fixture(scope="module")
def gateway(triton) -> GatewayThread:
    config = gateway_config(
        triton.ports.grpc_url,
        models={"identity": {"dispatch_window": 1}},
        scheduler={"max_queue_length_by_class": {"batch": 1}},
    )
    with GatewayThread(config) as running:
        yield running


@pytest.fixture(scope="module")
def stub(gateway) -> service_pb2_grpc.GRPCInferenceServiceStub:
    with grpc.insecure_channel(gateway.url) as channel:
        yield service_pb2_grpc.GRPCInferenceServiceStub(channel)


def metadata(key: str, klass: str | None = None) -> tuple[tuple[str, str], ...]:
    pairs = (("authorization", f"Bearer {key}"),)
    return pairs + ((("x-priority", klass),) if klass else ())


def details(error: grpc.RpcError) -> dict[str, object]:
    rich = rpc_status.from_call(error)
    assert rich is not None, "no grpc-status-details-bin trailer"
    decoded: dict[str, object] = {}
    for any_detail in rich.details:
        for kind in (error_details_pb2.RetryInfo, error_details_pb2.QuotaFailure):
            if any_detail.Is(kind.DESCRIPTOR):
                message = kind()
                any_detail.Unpack(message)
                decoded[kind.DESCRIPTOR.name] = message
    return decoded


def queued(gateway: GatewayThread) -> int:
    async def count() -> int:
        return sum(gateway.gateway.scheduler.snapshot().queued.values())

    return gateway.run(count())


@contextlib.contextmanager
def window_held(gateway: GatewayThread, model: str = "identity") -> Iterator[None]:
    """Occupy `model`'s whole dispatch window (1 here) from inside the gateway."""
    acquired = threading.Event()
    release = asyncio.Event()
    tenant = gateway.gateway.directory.tenants[0]

    async def hold() -> None:
        async with gateway.gateway.scheduler.slot(tenant=tenant, klass="critical", model=model, deadline=None):
            acquired.set()
            await release.wait()

    held = asyncio.run_coroutine_threadsafe(hold(), gateway.loop)
    assert acquired.wait(10)
    try:
        yield
    finally:
        gateway.loop.call_soon_threadsafe(release.set)
        held.result(10)


def wait_until(predicate, timeout: float = 10.0) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < deadline, "condition not reached"
        time.sleep(0.02)


def test_unauthenticated(stub) -> None:
    with pytest.raises(grpc.RpcError) as caught:
        stub.ModelInfer(identity_request(), timeout=10)
    assert caught.value.code() == grpc.StatusCode.UNAUTHENTICATED


def test_permission_denied_for_class_above_max(stub) -> None:
    require_model("identity")
    with pytest.raises(grpc.RpcError) as caught:
        stub.ModelInfer(identity_request(), metadata=metadata(GLOBEX_KEY, "critical"), timeout=10)
    assert caught.value.code() == grpc.StatusCode.PERMISSION_DENIED
    assert "critical" in caught.value.details()


def test_invalid_argument_for_unknown_class_and_malformed_request(stub, gateway) -> None:
    with pytest.raises(grpc.RpcError) as caught:
        stub.ModelInfer(identity_request(), metadata=metadata(ACME_KEY, "gold"), timeout=10)
    assert caught.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "gold" in caught.value.details()
    with grpc.insecure_channel(gateway.url) as channel:
        raw = channel.unary_unary("/inference.GRPCInferenceService/ModelInfer")
        with pytest.raises(grpc.RpcError) as caught:
            raw(b"\x0a\xff", metadata=metadata(ACME_KEY), timeout=10)
    assert caught.value.code() == grpc.StatusCode.INVALID_ARGUMENT


def test_resource_exhausted_carries_retry_info_and_quota_failure(stub) -> None:
    require_model("identity")
    stub.ModelInfer(identity_request(), metadata=metadata(TINY_KEY), timeout=10)  # the burst of 1
    with pytest.raises(grpc.RpcError) as caught:
        stub.ModelInfer(identity_request(), metadata=metadata(TINY_KEY), timeout=10)
    assert caught.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
    decoded = details(caught.value)
    retry = decoded["RetryInfo"].retry_delay.ToTimedelta().total_seconds()
    assert 0 < retry <= 10.0  # one request per 10 s
    violations = decoded["QuotaFailure"].violations
    assert violations and all(v.subject and v.description for v in violations)


def test_unavailable_when_the_class_queue_is_full(stub, gateway) -> None:
    require_model("identity")
    with window_held(gateway):
        waiting = stub.ModelInfer.future(identity_request(), metadata=metadata(ACME_KEY, "batch"), timeout=30)
        wait_until(lambda: queued(gateway) == 1)
        with pytest.raises(grpc.RpcError) as caught:
            stub.ModelInfer(identity_request(), metadata=metadata(ACME_KEY, "batch"), timeout=10)
        assert caught.value.code() == grpc.StatusCode.UNAVAILABLE
        assert "RetryInfo" in details(caught.value)
    # The queued one is served once the window frees up.
    assert waiting.result(timeout=30).model_name == "identity"


def test_deadline_exceeded_while_queued(stub, gateway) -> None:
    require_model("identity")
    with window_held(gateway):
        with pytest.raises(grpc.RpcError) as caught:
            stub.ModelInfer(identity_request(), metadata=metadata(ACME_KEY), timeout=0.3)
        assert caught.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED
        wait_until(lambda: queued(gateway) == 0)


def test_cancelled_while_queued_leaves_the_queue(stub, gateway) -> None:
    require_model("identity")
    with window_held(gateway):
        waiting = stub.ModelInfer.future(identity_request(), metadata=metadata(ACME_KEY), timeout=30)
        wait_until(lambda: queued(gateway) == 1)
        waiting.cancel()
        wait_until(lambda: queued(gateway) == 0)
        assert waiting.cancelled()


def test_unavailable_without_a_healthy_upstream_and_health_says_so(triton) -> None:
    dead = f"127.0.0.1:{free_port()}"  # nothing listens there
    with GatewayThread(gateway_config(dead)) as lonely, grpc.insecure_channel(lonely.url) as channel:
        stub = service_pb2_grpc.GRPCInferenceServiceStub(channel)
        with pytest.raises(grpc.RpcError) as caught:
            stub.ModelInfer(identity_request(), metadata=metadata(ACME_KEY), timeout=10)
        assert caught.value.code() == grpc.StatusCode.UNAVAILABLE
        assert "RetryInfo" in details(caught.value)
        health = health_pb2_grpc.HealthStub(channel)
        reply = health.Check(health_pb2.HealthCheckRequest(service=""), timeout=10)
        assert reply.status == health_pb2.HealthCheckResponse.NOT_SERVING
