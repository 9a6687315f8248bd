"""The gateway as a KServe v2 drop-in on real Triton: tritonclient with only URL + header changed.

Also: system shared memory, registered by an admin, used by a tenant's inference; no key
means UNAUTHENTICATED on every inference RPC; a tenant sees only its models;
admin-only RPCs are refused to other tenants; health, reflection and metrics answer.
"""

from __future__ import annotations

import os
import queue
import urllib.request

import grpc
import numpy as np
import pytest
import tritonclient.grpc as grpcclient
import tritonclient.utils.shared_memory as shm
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection_pb2, reflection_pb2_grpc
from tritonclient.grpc import service_pb2, service_pb2_grpc
from tritonclient.utils import InferenceServerException

from conftest import require_model
from gateway_harness import (
    ACME_KEY,
    ADMIN_KEY,
    GLOBEX_KEY,
    GatewayThread,
    bearer,
    gateway_config,
)

pytestmark = pytest.mark.integration


@pytest.fixture(scope="module")
def gateway(triton) -> GatewayThread:
    with GatewayThread(gateway_config(triton.ports.grpc_url)) as running:
        yield running


@pytest.fixture(scope="module")
def client(gateway) -> grpcclient.InferenceServerClient:
    with grpcclient.InferenceServerClient(gateway.url) as c:
        yield c


def identity_input(values: list[float]) -> grpcclient.InferInput:
    data = np.array([values], dtype=np.float32)
    tensor = grpcclient.InferInput("INPUT0", list(data.shape), "FP32")
    tensor.set_data_from_numpy(data)
    return tensor


def test_infer_through_gateway_like_direct(client) -> None:
    require_model("identity")
    result = client.infer(
        "identity", [identity_input([1.0, 2.5, -3.0])], request_id="r-1", headers=bearer(ACME_KEY)
    )
    np.testing.assert_array_equal(result.as_numpy("OUTPUT0"), [[1.0, 2.5, -3.0]])
    assert result.get_response().id == "r-1"


def test_x_api_key_and_priority_header(client) -> None:
    require_model("identity")
    result = client.infer(
        "identity",
        [identity_input([7.0])],
        headers={"x-api-key": ACME_KEY, "x-priority": "critical"},
        client_timeout=30,
    )
    np.testing.assert_array_equal(result.as_numpy("OUTPUT0"), [[7.0]])


def test_model_metadata_config_and_server_calls(client) -> None:
    require_model("identity")
    headers = bearer(ACME_KEY)
    assert client.is_server_live(headers=headers)
    assert client.is_server_ready(headers=headers)
    assert client.is_model_ready("identity", headers=headers)
    assert client.get_server_metadata(headers=headers).name == "triton"
    metadata = client.get_model_metadata("identity", headers=headers)
    assert [i.name for i in metadata.inputs] == ["INPUT0"]
    config = client.get_model_config("identity", headers=headers).config
    assert config.max_batch_size == 64
    stats = client.get_inference_statistics("identity", headers=headers)
    assert [s.name for s in stats.model_stats] == ["identity"]


def test_stream_infer_keeps_ids_and_order(client) -> None:
    require_model("identity")
    results: queue.Queue = queue.Queue()
    client.start_stream(callback=lambda result, error: results.put((result, error)), headers=bearer(ACME_KEY))
    try:
        for i in range(5):
            client.async_stream_infer("identity", [identity_input([float(i)])], request_id=f"s-{i}")
        got = {}
        for _ in range(5):
            result, error = results.get(timeout=30)
            assert error is None, error
            got[result.get_response().id] = result.as_numpy("OUTPUT0")[0][0]
    finally:
        client.stop_stream()
    assert got == {f"s-{i}": float(i) for i in range(5)}


def test_large_tensors_come_back_whole_unary_and_streamed(client) -> None:
    """1 MiB requests reach the gateway in many DATA frames: it collects the whole first
    message, reads it, appends its own fields and sends it on; tensors and ids come back."""
    require_model("identity")
    rng = np.random.default_rng(7)
    arrays = [rng.random((1, 1 << 18), dtype=np.float32) for _ in range(3)]

    def tensor(data: np.ndarray) -> grpcclient.InferInput:
        t = grpcclient.InferInput("INPUT0", list(data.shape), "FP32")
        t.set_data_from_numpy(data)
        return t

    result = client.infer("identity", [tensor(arrays[0])], request_id="big", headers=bearer(ACME_KEY))
    np.testing.assert_array_equal(result.as_numpy("OUTPUT0"), arrays[0])
    assert result.get_response().id == "big"
    results: queue.Queue = queue.Queue()
    client.start_stream(callback=lambda result, error: results.put((result, error)), headers=bearer(ACME_KEY))
    try:
        for i, data in enumerate(arrays):
            client.async_stream_infer("identity", [tensor(data)], request_id=f"big-{i}")
        got = {}
        for _ in arrays:
            result, error = results.get(timeout=60)
            assert error is None, error
            got[result.get_response().id] = result.as_numpy("OUTPUT0")
    finally:
        client.stop_stream()
    assert sorted(got) == [f"big-{i}" for i in range(len(arrays))]
    for i, data in enumerate(arrays):
        np.testing.assert_array_equal(got[f"big-{i}"], data)


def test_stream_refusal_is_reported_in_band_and_the_stream_goes_on(gateway) -> None:
    require_model("identity")
    require_model("minilm")
    results: queue.Queue = queue.Queue()
    with grpcclient.InferenceServerClient(gateway.url) as globex:
        globex.start_stream(
            callback=lambda result, error: results.put((result, error)), headers=bearer(GLOBEX_KEY)
        )
        try:
            text = grpcclient.InferInput("text", [1, 1], "BYTES")
            text.set_data_from_numpy(np.array([[b"hello"]], dtype=np.object_))
            globex.async_stream_infer("minilm", [text], request_id="denied")
            globex.async_stream_infer("identity", [identity_input([4.0])], request_id="allowed")
            outcomes = [results.get(timeout=30) for _ in range(2)]
        finally:
            globex.stop_stream()
    errors = [e for _, e in outcomes if e is not None]
    successes = [r for r, e in outcomes if e is None]
    assert len(errors) == 1 and "PERMISSION_DENIED" in str(errors[0])
    assert [r.get_response().id for r in successes] == ["allowed"]


def test_without_a_key_every_inference_rpc_is_unauthenticated(client, gateway) -> None:
    require_model("identity")
    with pytest.raises(InferenceServerException) as caught:
        client.infer("identity", [identity_input([1.0])])
    assert caught.value.status() == "StatusCode.UNAUTHENTICATED"
    with pytest.raises(InferenceServerException) as caught:
        client.infer("identity", [identity_input([1.0])], headers=bearer("not-a-key"))
    assert caught.value.status() == "StatusCode.UNAUTHENTICATED"

    # A stream without a key is refused as a whole, before any request is read.
    with grpc.insecure_channel(gateway.url) as channel:
        stub = service_pb2_grpc.GRPCInferenceServiceStub(channel)
        request = service_pb2.ModelInferRequest(model_name="identity")
        with pytest.raises(grpc.RpcError) as stream_error:
            list(stub.ModelStreamInfer(iter([request]), timeout=30))
        assert stream_error.value.code() == grpc.StatusCode.UNAUTHENTICATED
        # ... and so is every other RPC of the service.
        with pytest.raises(grpc.RpcError) as meta_error:
            stub.ModelMetadata(service_pb2.ModelMetadataRequest(name="identity"), timeout=30)
        assert meta_error.value.code() == grpc.StatusCode.UNAUTHENTICATED


def test_a_tenant_sees_only_its_models(client) -> None:
    require_model("identity")
    require_model("minilm")
    globex = bearer(GLOBEX_KEY)
    index = client.get_model_repository_index(headers=globex)
    assert {m.name for m in index.models} == {"identity"}
    everything = {m.name for m in client.get_model_repository_index(headers=bearer(ACME_KEY)).models}
    assert {"identity", "minilm"} <= everything
    stats = client.get_inference_statistics(headers=globex)
    assert {s.name for s in stats.model_stats} == {"identity"}
    for call in (
        lambda: client.get_model_metadata("minilm", headers=globex),
        lambda: client.get_model_config("minilm", headers=globex),
        lambda: client.is_model_ready("minilm", headers=globex),
        lambda: client.get_inference_statistics("minilm", headers=globex),
        # A model that does not exist looks the same as one that is not allowed.
        lambda: client.get_model_metadata("no-such-model", headers=globex),
    ):
        with pytest.raises(InferenceServerException) as caught:
            call()
        assert caught.value.status() == "StatusCode.PERMISSION_DENIED"
    text = grpcclient.InferInput("text", [1, 1], "BYTES")
    text.set_data_from_numpy(np.array([[b"hello"]], dtype=np.object_))
    with pytest.raises(InferenceServerException) as caught:
        client.infer("minilm", [text], headers=globex)
    assert caught.value.status() == "StatusCode.PERMISSION_DENIED"


def test_admin_only_rpcs(client) -> None:
    acme = bearer(ACME_KEY)
    admin_only = (
        lambda h: client.register_system_shared_memory("region", "/qosgate-test", 64, headers=h),
        lambda h: client.unregister_system_shared_memory("region", headers=h),
        lambda h: client.get_system_shared_memory_status(headers=h),
        lambda h: client.register_cuda_shared_memory("region", b"aGFuZGxl", 0, 64, headers=h),
        lambda h: client.unregister_cuda_shared_memory("region", headers=h),
        lambda h: client.get_cuda_shared_memory_status(headers=h),
        lambda h: client.load_model("identity", headers=h),
        lambda h: client.unload_model("identity", headers=h),
        lambda h: client.get_trace_settings(headers=h),
        lambda h: client.update_trace_settings(settings={"trace_rate": "1"}, headers=h),
        lambda h: client.get_log_settings(headers=h),
        lambda h: client.update_log_settings(settings={"log_verbose_level": 0}, headers=h),
    )
    for call in admin_only:
        with pytest.raises(InferenceServerException) as caught:
            call(acme)
        assert caught.value.status() == "StatusCode.PERMISSION_DENIED"
    # The admin's calls reach Triton (status calls are harmless to make for real).
    admin = bearer(ADMIN_KEY)
    assert client.get_system_shared_memory_status(headers=admin) is not None
    assert client.get_log_settings(headers=admin) is not None


def test_system_shared_memory_inputs_and_outputs(client) -> None:
    """tritonclient's system shared memory path through the gateway: the admin registers
    two regions, a tenant's inference names them, Triton reads the input from one and
    writes the output into the other (the response carries no tensor bytes)."""
    require_model("identity")
    admin = bearer(ADMIN_KEY)
    data = np.array([[1.0, 2.5, -3.0, 4.0]], dtype=np.float32)
    size = data.nbytes
    names = {"in": f"qosgate-in-{os.getpid()}", "out": f"qosgate-out-{os.getpid()}"}
    regions = {side: shm.create_shared_memory_region(name, f"/{name}", size) for side, name in names.items()}
    try:
        shm.set_shared_memory_region(regions["in"], [data])
        for name in names.values():
            client.register_system_shared_memory(name, f"/{name}", size, headers=admin)
        tensor = grpcclient.InferInput("INPUT0", list(data.shape), "FP32")
        tensor.set_shared_memory(names["in"], size)
        output = grpcclient.InferRequestedOutput("OUTPUT0")
        output.set_shared_memory(names["out"], size)
        result = client.infer("identity", [tensor], outputs=[output], headers=bearer(ACME_KEY))
        assert not any(result.get_response().raw_output_contents)  # the tensor is in the region
        np.testing.assert_array_equal(shm.get_contents_as_numpy(regions["out"], np.float32, list(data.shape)), data)
        registered = client.get_system_shared_memory_status(headers=admin, as_json=True)["regions"]
        assert set(names.values()) <= set(registered)
    finally:
        for name in names.values():
            client.unregister_system_shared_memory(name, headers=admin)
        for region in regions.values():
            shm.destroy_shared_memory_region(region)


def test_upstream_errors_pass_through_with_their_code(client) -> None:
    require_model("identity")
    wrong = grpcclient.InferInput("NOT_AN_INPUT", [1, 1], "FP32")
    wrong.set_data_from_numpy(np.array([[1.0]], dtype=np.float32))
    with pytest.raises(InferenceServerException) as caught:
        client.infer("identity", [wrong], headers=bearer(ACME_KEY))
    assert caught.value.status() == "StatusCode.INVALID_ARGUMENT"
    assert "NOT_AN_INPUT" in caught.value.message()


def test_health_reflection_and_metrics(gateway, client) -> None:
    require_model("identity")
    client.infer("identity", [identity_input([1.0])], headers=bearer(ACME_KEY))
    with grpc.insecure_channel(gateway.url) as channel:
        health = health_pb2_grpc.HealthStub(channel)
        for service in ("", "inference.GRPCInferenceService"):
            reply = health.Check(health_pb2.HealthCheckRequest(service=service), timeout=10)
            assert reply.status == health_pb2.HealthCheckResponse.SERVING
        watch = health.Watch(health_pb2.HealthCheckRequest(service=""), timeout=10)
        assert next(watch).status == health_pb2.HealthCheckResponse.SERVING
        watch.cancel()
        reflection = reflection_pb2_grpc.ServerReflectionStub(channel)
        replies = reflection.ServerReflectionInfo(
            iter([reflection_pb2.ServerReflectionRequest(list_services="")]), timeout=10
        )
        services = {s.name for s in next(replies).list_services_response.service}
    assert {"inference.GRPCInferenceService", "grpc.health.v1.Health"} <= services
    url = f"http://127.0.0.1:{gateway.gateway.metrics_port}/metrics"
    with urllib.request.urlopen(url, timeout=10) as response:
        text = response.read().decode()
    assert 'qosgate_requests_total{class="interactive",code="OK",model="identity",rpc="ModelInfer",tenant="acme"}' in text
    assert 'qosgate_upstream_live{upstream="local"} 1.0' in text
    assert "qosgate_queue_wait_seconds_bucket" in text
    assert "qosgate_upstream_latency_seconds_bucket" in text
