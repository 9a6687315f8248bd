"""Regression tests for bad input and ambiguous credentials, through a real gateway in front
of a real Triton and real gRPC channels (issue 10, "Wrong codes" and "Two authorization
headers").

Each request-shaped error is INVALID_ARGUMENT after authentication, answered without a
traceback in the log; inside a KServe stream it is answered in the stream and the stream
goes on. A call presenting more than one credential is UNAUTHENTICATED.
"""

from __future__ import annotations

import logging
from collections.abc import Iterator

import grpc
import httpx
import pytest
from tritonclient.grpc import service_pb2

from conftest import require_model
from gateway_harness import ACME_KEY, GLOBEX_KEY, GatewayThread, gateway_config, identity_request
from qosgate.v1 import admin_pb2, batch_pb2, embedding_pb2, generation_pb2

pytestmark = pytest.mark.integration

KSERVE = "/inference.GRPCInferenceService/"
# Bytes that are no protobuf message at all: a field with wire type 7.
GARBAGE = b"\xff\xff\xff\xff"
# A ModelInferRequest whose model_name (field 1) is not UTF-8.
BAD_UTF8_MODEL = b"\x0a\x02\xff\xfe"
V1_UNARY = (
    "/qosgate.v1.GenerationService/Generate",
    "/qosgate.v1.EmbeddingService/Embed",
    "/qosgate.v1.AdminService/GetUsage",
    "/qosgate.v1.BatchService/GetBatch",
    "/qosgate.v1.BatchService/ListBatches",
    "/qosgate.v1.BatchService/CancelBatch",
)


@pytest.fixture(scope="module")
def gateway(triton) -> Iterator[GatewayThread]:
    config = gateway_config(
        triton.ports.grpc_url, batch={"callback_allowlist": ["http://127.0.0.1:9/hooks/"]}
    )
    with GatewayThread(config) as running:
        yield running


@pytest.fixture(scope="module")
def channel(gateway: GatewayThread) -> Iterator[grpc.Channel]:
    with grpc.insecure_channel(gateway.url) as channel:
        yield channel


@pytest.fixture
def tracebacks(caplog: pytest.LogCaptureFixture) -> Iterator[list[logging.LogRecord]]:
    """Log records of the test that carry a traceback (the gateway runs in this process)."""
    caplog.set_level(logging.INFO)
    found: list[logging.LogRecord] = []
    yield found
    found.extend(r for r in caplog.records if r.exc_info or r.exc_text)
    assert not found, f"tracebacks logged: {[r.getMessage() for r in found]}"


def bearer(key: str) -> tuple[tuple[str, str], ...]:
    return (("authorization", f"Bearer {key}"),)


def code_of(call, *args, **kwargs) -> grpc.StatusCode:
    try:
        call(*args, timeout=10, **kwargs)
    except grpc.RpcError as e:
        return e.code()
    return grpc.StatusCode.OK


@pytest.mark.parametrize("method", V1_UNARY)
def test_unparseable_v1_request_is_unauthenticated_then_invalid_argument(
    channel: grpc.Channel, method: str, tracebacks: list[logging.LogRecord]
) -> None:
    call = channel.unary_unary(method)
    # Before the key is checked nothing is parsed: whatever the bytes, UNAUTHENTICATED.
    assert code_of(call, GARBAGE) == grpc.StatusCode.UNAUTHENTICATED
    assert code_of(call, GARBAGE, metadata=bearer("wrong-key")) == grpc.StatusCode.UNAUTHENTICATED
    with pytest.raises(grpc.RpcError) as caught:
        call(GARBAGE, metadata=bearer(GLOBEX_KEY), timeout=10)
    assert caught.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert caught.value.details().startswith("malformed qosgate.v1.")


@pytest.mark.parametrize(
    "method", ["/qosgate.v1.GenerationService/GenerateStream", "/qosgate.v1.BatchService/StreamBatchResults"]
)
def test_unparseable_v1_stream_request_is_invalid_argument(
    channel: grpc.Channel, method: str, tracebacks: list[logging.LogRecord]
) -> None:
    call = channel.unary_stream(method)
    assert code_of(lambda *a, **k: list(call(*a, **k)), GARBAGE) == grpc.StatusCode.UNAUTHENTICATED
    code = code_of(lambda *a, **k: list(call(*a, **k)), GARBAGE, metadata=bearer(GLOBEX_KEY))
    assert code == grpc.StatusCode.INVALID_ARGUMENT


def test_unparseable_create_batch_chunk_is_invalid_argument_and_queues_nothing(
    channel: grpc.Channel, tracebacks: list[logging.LogRecord]
) -> None:
    call = channel.stream_unary("/qosgate.v1.BatchService/CreateBatch")
    header = batch_pb2.CreateBatchRequest(header=batch_pb2.BatchHeader(model="identity"))
    chunks = [header.SerializeToString(), GARBAGE]
    assert code_of(call, iter(chunks)) == grpc.StatusCode.UNAUTHENTICATED
    assert code_of(call, iter(chunks), metadata=bearer(GLOBEX_KEY)) == grpc.StatusCode.INVALID_ARGUMENT
    listed = channel.unary_unary(
        "/qosgate.v1.BatchService/ListBatches",
        request_serializer=batch_pb2.ListBatchesRequest.SerializeToString,
        response_deserializer=batch_pb2.ListBatchesResponse.FromString,
    )(batch_pb2.ListBatchesRequest(), metadata=bearer(GLOBEX_KEY), timeout=10)
    assert not listed.batches


def test_stream_batch_results_offset_beyond_int64_is_invalid_argument(
    channel: grpc.Channel, tracebacks: list[logging.LogRecord]
) -> None:
    call = channel.unary_stream(
        "/qosgate.v1.BatchService/StreamBatchResults",
        request_serializer=batch_pb2.StreamBatchResultsRequest.SerializeToString,
    )
    for offset in (2**63, 2**64 - 1):
        request = batch_pb2.StreamBatchResultsRequest(batch_id="b-1", offset=offset)
        with pytest.raises(grpc.RpcError) as caught:
            list(call(request, metadata=bearer(GLOBEX_KEY), timeout=10))
        assert caught.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert "offset" in caught.value.details()


def test_create_batch_with_unparseable_callback_url_is_invalid_argument(
    channel: grpc.Channel, tracebacks: list[logging.LogRecord]
) -> None:
    call = channel.stream_unary(
        "/qosgate.v1.BatchService/CreateBatch",
        request_serializer=batch_pb2.CreateBatchRequest.SerializeToString,
    )
    for url in ("http://[", "http://[::1", "https://]x["):
        header = batch_pb2.BatchHeader(model="identity", callback_url=url)
        with pytest.raises(grpc.RpcError) as caught:
            call(iter([batch_pb2.CreateBatchRequest(header=header)]), metadata=bearer(GLOBEX_KEY), timeout=10)
        assert caught.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert "callback_url" in caught.value.details()


@pytest.mark.parametrize(
    ("method", "raw"),
    [
        ("ModelInfer", GARBAGE),
        ("ModelInfer", BAD_UTF8_MODEL),
        # A tensor's datatype (inputs[0].datatype) that is not UTF-8: deep inside the message.
        ("ModelInfer", b"\x0a\x08identity\x2a\x04\x12\x02\xc3\x28"),
        ("ServerLive", GARBAGE),
        ("RepositoryIndex", BAD_UTF8_MODEL),
        ("ModelConfig", BAD_UTF8_MODEL),
        ("LogSettings", GARBAGE),
    ],
)
def test_unparseable_kserve_request_is_invalid_argument_not_tritons_internal(
    channel: grpc.Channel, method: str, raw: bytes, tracebacks: list[logging.LogRecord]
) -> None:
    call = channel.unary_unary(KSERVE + method)
    assert code_of(call, raw) == grpc.StatusCode.UNAUTHENTICATED
    # Triton itself answers INTERNAL "Unable to parse request": the gateway must not forward.
    assert code_of(call, raw, metadata=bearer(ACME_KEY)) == grpc.StatusCode.INVALID_ARGUMENT


def test_invalid_request_in_a_stream_is_answered_in_it_and_the_stream_goes_on(
    channel: grpc.Channel, tracebacks: list[logging.LogRecord]
) -> None:
    require_model("identity")
    call = channel.stream_stream(
        KSERVE + "ModelStreamInfer", response_deserializer=service_pb2.ModelStreamInferResponse.FromString
    )
    requests = [
        identity_request("first").SerializeToString(),
        BAD_UTF8_MODEL,
        GARBAGE,
        identity_request("last").SerializeToString(),
    ]
    # Each request is answered (requests run concurrently: order is not promised), and
    # the stream ends OK once the caller has half-closed.
    answers = list(call(iter(requests), metadata=bearer(ACME_KEY), timeout=30))
    served = sorted(a.infer_response.id for a in answers if not a.error_message)
    refused = [a.error_message for a in answers if a.error_message]
    assert served == ["first", "last"]
    assert len(refused) == 2
    assert all(m.startswith("INVALID_ARGUMENT: malformed ModelInferRequest") for m in refused), refused


def test_error_messages_quoting_huge_values_stay_small(
    channel: grpc.Channel, tracebacks: list[logging.LogRecord]
) -> None:
    # A model name far longer than any model's: refused by the gateway, never sent to
    # Triton (which would quote it back in a status header too long for any client, and
    # for the gateway's own connection to it), whatever models the tenant may use; the
    # refusal's own message stays small.
    request = identity_request()
    request.model_name = "m" * 200_000
    call = channel.unary_unary(KSERVE + "ModelInfer", request_serializer=service_pb2.ModelInferRequest.SerializeToString)
    for key in (GLOBEX_KEY, ACME_KEY):
        with pytest.raises(grpc.RpcError) as caught:
            call(request, metadata=bearer(key), timeout=10)
        assert caught.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert len(caught.value.details()) <= 1024
    assert code_of(call, identity_request(), metadata=bearer(ACME_KEY)) == grpc.StatusCode.OK


@pytest.mark.parametrize("length", [10_000, 70_000])
def test_a_huge_value_triton_would_quote_is_cut_short_or_refused(
    channel: grpc.Channel, tracebacks: list[logging.LogRecord], length: int
) -> None:
    require_model("identity")
    # Triton quotes the version in its message: 10 KB reach it and come back cut short
    # (a gRPC client refuses response metadata over 8 KiB); 70 KB would come back in a
    # header longer than HTTP/2 can carry, so the gateway refuses them itself.
    request = service_pb2.ModelStatisticsRequest(name="identity", version="9" * length)
    call = channel.unary_unary(
        KSERVE + "ModelStatistics", request_serializer=service_pb2.ModelStatisticsRequest.SerializeToString
    )
    with pytest.raises(grpc.RpcError) as caught:
        call(request, metadata=bearer(ACME_KEY), timeout=10)
    assert caught.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert len(caught.value.details()) <= 1024
    # The gateway's connections to Triton are whole: the next call is served.
    live = channel.unary_unary(KSERVE + "ServerLive", request_serializer=service_pb2.ServerLiveRequest.SerializeToString)
    assert code_of(live, service_pb2.ServerLiveRequest(), metadata=bearer(ACME_KEY)) == grpc.StatusCode.OK


AMBIGUOUS = [
    pytest.param([("authorization", "Bearer nope"), ("authorization", f"Bearer {ACME_KEY}")], id="invalid-then-valid"),
    pytest.param([("authorization", f"Bearer {ACME_KEY}"), ("authorization", "Bearer nope")], id="valid-then-invalid"),
    pytest.param(
        [("authorization", f"Bearer {ACME_KEY}"), ("authorization", f"Bearer {GLOBEX_KEY}")], id="two-tenants"
    ),
    pytest.param([("x-api-key", "nope"), ("x-api-key", ACME_KEY)], id="two-x-api-key"),
    pytest.param([("authorization", "Bearer nope"), ("x-api-key", ACME_KEY)], id="disagreeing-headers"),
    pytest.param([("x-api-key", GLOBEX_KEY), ("authorization", f"Bearer {ACME_KEY}")], id="two-tenants-two-headers"),
]


@pytest.mark.parametrize("metadata", AMBIGUOUS)
def test_ambiguous_credentials_are_unauthenticated(
    channel: grpc.Channel, metadata: list[tuple[str, str]]
) -> None:
    infer = channel.unary_unary(KSERVE + "ModelInfer", request_serializer=service_pb2.ModelInferRequest.SerializeToString)
    assert code_of(infer, identity_request(), metadata=metadata) == grpc.StatusCode.UNAUTHENTICATED
    live = channel.unary_unary(KSERVE + "ServerLive", request_serializer=service_pb2.ServerLiveRequest.SerializeToString)
    assert code_of(live, service_pb2.ServerLiveRequest(), metadata=metadata) == grpc.StatusCode.UNAUTHENTICATED
    embed = channel.unary_unary(
        "/qosgate.v1.EmbeddingService/Embed", request_serializer=embedding_pb2.EmbedRequest.SerializeToString
    )
    assert code_of(embed, embedding_pb2.EmbedRequest(model="identity"), metadata=metadata) == (
        grpc.StatusCode.UNAUTHENTICATED
    )
    stream = channel.stream_stream(KSERVE + "ModelStreamInfer")
    code = code_of(lambda *a, **k: list(stream(*a, **k)), iter([identity_request().SerializeToString()]), metadata=metadata)
    assert code == grpc.StatusCode.UNAUTHENTICATED


def test_one_key_in_both_headers_is_served(channel: grpc.Channel) -> None:
    require_model("identity")
    infer = channel.unary_unary(KSERVE + "ModelInfer", request_serializer=service_pb2.ModelInferRequest.SerializeToString)
    metadata = [("authorization", f"Bearer {ACME_KEY}"), ("x-api-key", ACME_KEY)]
    assert code_of(infer, identity_request(), metadata=metadata) == grpc.StatusCode.OK


# Every RPC the gateway serves, whatever serves it (the relay or its gRPC server).
EVERY_RPC = [
    method
    for module, service in (
        (service_pb2, "GRPCInferenceService"),
        (generation_pb2, "GenerationService"),
        (embedding_pb2, "EmbeddingService"),
        (admin_pb2, "AdminService"),
        (batch_pb2, "BatchService"),
    )
    for method in module.DESCRIPTOR.services_by_name[service].methods
]
# Credentials that present no key: empty, or only the padding around one.
EMPTY_CREDENTIALS = [
    [("authorization", "Bearer ")],
    [("authorization", "  Bearer   ")],
    [("authorization", "")],
    [("x-api-key", "")],
    [("x-api-key", "   ")],
    [("authorization", f"Bearer {ACME_KEY}"), ("x-api-key", "")],
    [("x-api-key", " "), ("authorization", f"Bearer {ACME_KEY}")],
]


def call_code(channel: grpc.Channel, method, raw: bytes, metadata: list[tuple[str, str]]) -> grpc.StatusCode:
    """The status of one call of `method` carrying `raw` (streams: one message), whatever its shape."""
    path = f"/{method.containing_service.full_name}/{method.name}"
    if method.client_streaming and method.server_streaming:
        call = channel.stream_stream(path)
        return code_of(lambda **k: list(call(iter([raw]), **k)), metadata=metadata)
    if method.client_streaming:
        return code_of(channel.stream_unary(path), iter([raw]), metadata=metadata)
    if method.server_streaming:
        call = channel.unary_stream(path)
        return code_of(lambda **k: list(call(raw, **k)), metadata=metadata)
    return code_of(channel.unary_unary(path), raw, metadata=metadata)


@pytest.mark.parametrize("method", EVERY_RPC, ids=lambda m: m.full_name)
def test_empty_credentials_are_unauthenticated_on_every_rpc(
    channel: grpc.Channel, method, tracebacks: list[logging.LogRecord]
) -> None:
    # Never a stream reset (INTERNAL to the caller), whatever the padding: a gRPC server
    # trims header values, and an empty key is no key.
    for metadata in EMPTY_CREDENTIALS:
        assert call_code(channel, method, b"", metadata) == grpc.StatusCode.UNAUTHENTICATED, metadata


def test_header_values_are_read_trimmed(channel: grpc.Channel, tracebacks: list[logging.LogRecord]) -> None:
    require_model("identity")
    padded = [("authorization", f"  Bearer {ACME_KEY}  "), ("x-priority", "  critical ")]
    infer = channel.unary_unary(KSERVE + "ModelInfer", request_serializer=service_pb2.ModelInferRequest.SerializeToString)
    assert code_of(infer, identity_request(), metadata=padded) == grpc.StatusCode.OK
    live = channel.unary_unary(KSERVE + "ServerLive", request_serializer=service_pb2.ServerLiveRequest.SerializeToString)
    assert code_of(live, service_pb2.ServerLiveRequest(), metadata=[("x-api-key", f" {ACME_KEY} ")]) == grpc.StatusCode.OK
    stream = channel.stream_stream(
        KSERVE + "ModelStreamInfer", response_deserializer=service_pb2.ModelStreamInferResponse.FromString
    )
    answers = list(stream(iter([identity_request("padded").SerializeToString()]), metadata=padded, timeout=30))
    assert [a.infer_response.id for a in answers if not a.error_message] == ["padded"], answers
    # globex may not use critical: its padded class is read, and refused as itself.
    refused = [("authorization", f"Bearer {GLOBEX_KEY}"), ("x-priority", " critical")]
    assert code_of(infer, identity_request(), metadata=refused) == grpc.StatusCode.PERMISSION_DENIED


def _count(gateway: GatewayThread, name: str, **labels: str) -> float:
    return gateway.gateway.metrics.registry.get_sample_value(name, labels) or 0.0


@pytest.mark.parametrize(
    ("rpc", "call"),
    [
        ("ModelInfer", lambda channel, md: channel.unary_unary(KSERVE + "ModelInfer")(b"", metadata=md, timeout=10)),
        (
            "ModelStreamInfer",
            lambda channel, md: list(channel.stream_stream(KSERVE + "ModelStreamInfer")(iter([b""]), metadata=md, timeout=10)),
        ),
        ("ServerLive", lambda channel, md: channel.unary_unary(KSERVE + "ServerLive")(b"", metadata=md, timeout=10)),
        (
            "GenerateStream",
            lambda channel, md: list(channel.unary_stream("/qosgate.v1.GenerationService/GenerateStream")(b"", metadata=md, timeout=10)),
        ),
        ("Embed", lambda channel, md: channel.unary_unary("/qosgate.v1.EmbeddingService/Embed")(b"", metadata=md, timeout=10)),
        ("GetUsage", lambda channel, md: channel.unary_unary("/qosgate.v1.AdminService/GetUsage")(b"", metadata=md, timeout=10)),
        ("openai.ChatCompletions", None),
    ],
)
def test_a_refused_caller_is_counted_the_same_way_from_every_front_end(
    gateway: GatewayThread, channel: grpc.Channel, rpc: str, call
) -> None:
    rejected = {"reason": "unauthenticated", "tenant": "", "class": ""}
    done = {"rpc": rpc, "model": "", "tenant": "", "class": "", "code": "UNAUTHENTICATED"}
    before = _count(gateway, "qosgate_rejections_total", **rejected), _count(gateway, "qosgate_requests_total", **done)
    if call is None:  # the OpenAI API
        response = httpx.post(f"{gateway.openai_url}/chat/completions", content=b"{}", headers={"authorization": "Bearer nope"})
        assert response.status_code == 401
    else:
        with pytest.raises(grpc.RpcError) as caught:
            call(channel, [("authorization", "Bearer nope")])
        assert caught.value.code() == grpc.StatusCode.UNAUTHENTICATED
    after = _count(gateway, "qosgate_rejections_total", **rejected), _count(gateway, "qosgate_requests_total", **done)
    assert after == (before[0] + 1, before[1] + 1)


def test_a_model_name_with_a_control_character_reaches_no_model(channel: grpc.Channel, tracebacks: list[logging.LogRecord]) -> None:
    """Triton ends a model name at its first NUL: `identity\\0-public` would run identity under
    a name that a tenant's pattern `*-public` allows, and count as a model of its own."""
    require_model("identity")
    metadata = [("authorization", f"Bearer {ACME_KEY}")]
    infer = channel.unary_unary(KSERVE + "ModelInfer", request_serializer=service_pb2.ModelInferRequest.SerializeToString)
    config = channel.unary_unary(KSERVE + "ModelConfig", request_serializer=service_pb2.ModelConfigRequest.SerializeToString)
    stream = channel.stream_stream(
        KSERVE + "ModelStreamInfer",
        request_serializer=service_pb2.ModelInferRequest.SerializeToString,
        response_deserializer=service_pb2.ModelStreamInferResponse.FromString,
    )
    for name in ("identity\x00-public", "identity\x01", "identity\x7f"):
        request = identity_request("named")
        request.model_name = name
        assert code_of(infer, request, metadata=metadata) == grpc.StatusCode.INVALID_ARGUMENT, name
        assert code_of(config, service_pb2.ModelConfigRequest(name=name), metadata=metadata) == grpc.StatusCode.INVALID_ARGUMENT
        answers = list(stream(iter([request]), metadata=metadata, timeout=30))
        assert [a.error_message.split(":")[0] for a in answers] == ["INVALID_ARGUMENT"], answers
    request = identity_request()
    assert code_of(infer, request, metadata=metadata) == grpc.StatusCode.OK  # the name without it is served
