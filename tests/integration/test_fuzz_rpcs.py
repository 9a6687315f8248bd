"""Property-based fuzzing of every RPC the gateway serves, through a real gateway in front
of a real Triton (issue 10).

Every method of inference.GRPCInferenceService and of each qosgate.v1 service gets
batches of requests of three kinds: raw random bytes, mutated valid messages (bytes set,
inserted, deleted, truncated, a second message appended), and well-formed messages whose
fields hold hostile values (huge or empty strings, invalid names, extreme numbers, NaN,
unknown enum values), built from the request's descriptor. After each batch a valid
call must be served. What must hold for every call:

- no UNKNOWN, and no INTERNAL: a request-shaped error is the caller's, never a bug;
- no hang: every call has a deadline, and DEADLINE_EXCEEDED counts as a hang;
- a stream answers every request it was sent, in the stream.

The fuzzing tenant may use the identity model only, so no case reaches the LLM, and it is
not an admin: admin RPCs are parsed and refused, never forwarded (a fuzzed
RepositoryModelUnload or LogSettings would change the Triton every other test shares).
The cases run and the codes seen are printed at the end of the module.
"""

from __future__ import annotations

import collections
import logging
import math
import time
from collections.abc import Iterator
from typing import Any

import grpc
import pytest
from google.protobuf import message_factory
from google.protobuf.descriptor import Descriptor, FieldDescriptor, MethodDescriptor
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from tritonclient.grpc import service_pb2

from conftest import require_model
from gateway_harness import GatewayThread, TracebackCollector, gateway_config, identity_request
from qosgate.v1 import admin_pb2, batch_pb2, embedding_pb2, generation_pb2

pytestmark = pytest.mark.integration

FUZZ_KEY = "test-fuzz-key"
DEADLINE_S = 20.0
BATCHES_PER_RPC = 25
MAX_BATCH = 8
# Codes a refused request may get (OK: served). Not RESOURCE_EXHAUSTED: the fuzzing tenant
# has no quotas, and it is what gRPC answers when a status trailer is too big.
EXPECTED = {
    grpc.StatusCode.OK,
    grpc.StatusCode.INVALID_ARGUMENT,
    grpc.StatusCode.PERMISSION_DENIED,
    grpc.StatusCode.NOT_FOUND,
    grpc.StatusCode.UNIMPLEMENTED,  # Triton: "'repository_name' specification is not supported"
}
SERVICES = [
    service_pb2.DESCRIPTOR.services_by_name["GRPCInferenceService"],
    generation_pb2.DESCRIPTOR.services_by_name["GenerationService"],
    embedding_pb2.DESCRIPTOR.services_by_name["EmbeddingService"],
    admin_pb2.DESCRIPTOR.services_by_name["AdminService"],
    batch_pb2.DESCRIPTOR.services_by_name["BatchService"],
]
METHODS = {m.full_name: m for service in SERVICES for m in service.methods}

# What a careless or hostile caller puts in fields: names of real and absent models,
# path tricks, URLs that do not parse, control and non-BMP characters, the huge.
HOSTILE_TEXT = st.one_of(
    st.sampled_from(
        [
            "",
            "identity",
            "smollm2",
            "minilm",
            "no-such-model",
            "*",
            "../../etc/passwd",
            "http://[",
            "http://127.0.0.1:9/hooks/x",
            "critical",
            "batch",
            "\x00",
            "\ud7ff\ue000\U0010ffff",
            "INPUT0",
            "FP32",
            "BYTES",
            "priority",
            "timeout",
            "triton_enable_empty_final_response",
        ]
    ),
    st.text(max_size=12),
    st.integers(1_000, 70_000).map(lambda n: "m" * n),
)
INTS = {
    FieldDescriptor.TYPE_INT32: st.sampled_from([0, 1, -1, 2**31 - 1, -(2**31)]),
    FieldDescriptor.TYPE_SINT32: st.sampled_from([0, -1, 2**31 - 1, -(2**31)]),
    FieldDescriptor.TYPE_SFIXED32: st.sampled_from([0, -1, 2**31 - 1]),
    FieldDescriptor.TYPE_INT64: st.sampled_from([0, 1, -1, 2**62, 2**63 - 1, -(2**63)]),
    FieldDescriptor.TYPE_SINT64: st.sampled_from([0, -1, 2**63 - 1, -(2**63)]),
    FieldDescriptor.TYPE_SFIXED64: st.sampled_from([0, -1, 2**63 - 1]),
    FieldDescriptor.TYPE_UINT32: st.sampled_from([0, 1, 2, 16, 2**31, 2**32 - 1]),
    FieldDescriptor.TYPE_FIXED32: st.sampled_from([0, 2**32 - 1]),
    FieldDescriptor.TYPE_UINT64: st.sampled_from([0, 1, 2**63 - 1, 2**63, 2**64 - 1]),
    FieldDescriptor.TYPE_FIXED64: st.sampled_from([0, 2**64 - 1]),
    FieldDescriptor.TYPE_ENUM: st.sampled_from([0, 1, 2, 3, 99, -1]),
}
FLOATS = st.sampled_from([0.0, -0.0, 0.5, 1.0, -1.0, 1e9, 1e38, math.inf, -math.inf, math.nan])


def _value(field: FieldDescriptor, depth: int) -> st.SearchStrategy[Any]:
    if field.type == FieldDescriptor.TYPE_MESSAGE:
        return _fields(field.message_type, depth + 1)
    if field.type == FieldDescriptor.TYPE_STRING:
        return HOSTILE_TEXT
    if field.type == FieldDescriptor.TYPE_BYTES:
        return st.binary(max_size=64)
    if field.type == FieldDescriptor.TYPE_BOOL:
        return st.booleans()
    if field.type in (FieldDescriptor.TYPE_FLOAT, FieldDescriptor.TYPE_DOUBLE):
        return FLOATS
    return INTS[field.type]


def _fields(descriptor: Descriptor, depth: int = 0) -> st.SearchStrategy[dict[str, Any]]:
    """Values for some fields of `descriptor`, as {name: value or list of values}."""
    if depth > 3:
        return st.just({})
    per_field = {}
    for field in descriptor.fields:
        value = _value(field, depth)
        per_field[field.name] = st.lists(value, max_size=3) if field.is_repeated else value
    return st.fixed_dictionaries({}, optional=per_field)


def _fill(message: Any, values: dict[str, Any]) -> None:
    for name, value in values.items():
        field = message.DESCRIPTOR.fields_by_name[name]
        if field.message_type is not None and field.message_type.GetOptions().map_entry:
            entries = getattr(message, name)
            key_field, value_field = field.message_type.fields_by_name["key"], field.message_type.fields_by_name["value"]
            for entry in value:
                key = entry.get("key", "" if key_field.type == FieldDescriptor.TYPE_STRING else 0)
                if value_field.message_type is not None:
                    _fill(entries[key], entry.get("value", {}))
                elif "value" in entry:
                    entries[key] = entry["value"]
        elif field.is_repeated and field.message_type is not None:
            for item in value:
                _fill(getattr(message, name).add(), item)
        elif field.message_type is not None:
            _fill(getattr(message, name), value)
        elif field.is_repeated:
            getattr(message, name).extend(value)
        else:
            setattr(message, name, value)


def _hostile(method: MethodDescriptor) -> st.SearchStrategy[bytes]:
    """Well-formed requests of `method` with hostile field values."""
    message_type = message_factory.GetMessageClass(method.input_type)

    def build(values: dict[str, Any]) -> bytes:
        message = message_type()
        try:
            _fill(message, values)
        except (ValueError, TypeError):  # e.g. a oneof set twice: keep what was set
            pass
        return message.SerializeToString()

    return _fields(method.input_type).map(build)


# A valid request per method where the empty message is not one (or too dull a seed).
VALID = {
    "inference.GRPCInferenceService.ModelInfer": identity_request("fuzz").SerializeToString(),
    "inference.GRPCInferenceService.ModelStreamInfer": identity_request("fuzz").SerializeToString(),
    "inference.GRPCInferenceService.ModelReady": service_pb2.ModelReadyRequest(name="identity").SerializeToString(),
    "inference.GRPCInferenceService.ModelMetadata": service_pb2.ModelMetadataRequest(
        name="identity"
    ).SerializeToString(),
    "inference.GRPCInferenceService.ModelConfig": service_pb2.ModelConfigRequest(name="identity").SerializeToString(),
    "inference.GRPCInferenceService.ModelStatistics": service_pb2.ModelStatisticsRequest(
        name="identity"
    ).SerializeToString(),
    "qosgate.v1.EmbeddingService.Embed": embedding_pb2.EmbedRequest(
        model="identity", inputs=["a"]
    ).SerializeToString(),
    "qosgate.v1.GenerationService.Generate": generation_pb2.GenerateRequest(
        model="identity", prompt="hi", sampling=generation_pb2.SamplingParams(max_tokens=1)
    ).SerializeToString(),
    "qosgate.v1.GenerationService.GenerateStream": generation_pb2.GenerateStreamRequest(
        model="identity", prompt="hi", sampling=generation_pb2.SamplingParams(max_tokens=1)
    ).SerializeToString(),
    "qosgate.v1.BatchService.CreateBatch": batch_pb2.CreateBatchRequest(
        header=batch_pb2.BatchHeader(model="identity")
    ).SerializeToString(),
    "qosgate.v1.BatchService.CreateBatch items": batch_pb2.CreateBatchRequest(
        items=batch_pb2.BatchItems(
            items=[batch_pb2.BatchItem(custom_id="a", embed=embedding_pb2.EmbedRequest(inputs=["x"]))]
        )
    ).SerializeToString(),
    "qosgate.v1.BatchService.StreamBatchResults": batch_pb2.StreamBatchResultsRequest(
        batch_id="b-none", offset=1
    ).SerializeToString(),
}


@st.composite
def _mutated(draw: st.DrawFn, seeds: st.SearchStrategy[bytes]) -> bytes:
    raw = bytearray(draw(seeds))
    for _ in range(draw(st.integers(1, 4))):
        edit = draw(st.sampled_from(["set", "insert", "delete", "truncate", "append"]))
        at = draw(st.integers(0, max(len(raw) - 1, 0)))
        if edit == "set" and raw:
            raw[at] = draw(st.integers(0, 255))
        elif edit == "insert":
            raw[at:at] = draw(st.binary(min_size=1, max_size=4))
        elif edit == "delete" and raw:
            del raw[at]
        elif edit == "truncate":
            del raw[at:]
        elif edit == "append":
            raw += draw(seeds)
    return bytes(raw)


def requests_of(method: MethodDescriptor) -> st.SearchStrategy[bytes]:
    hostile = _hostile(method)
    seeds = st.one_of(st.just(VALID.get(method.full_name, b"")), hostile)
    return st.one_of(st.binary(max_size=64), _mutated(seeds), hostile)


TRACEBACKS = TracebackCollector()


def batches_of(method: MethodDescriptor) -> st.SearchStrategy[list[bytes]]:
    """Requests for one batch: for a client stream, the chunks of one call, which then
    often open with a valid first chunk so that the later ones are read too."""
    requests = st.lists(requests_of(method), min_size=1, max_size=MAX_BATCH)
    first = VALID.get(method.full_name)
    if not method.client_streaming or method.server_streaming or first is None:
        return requests
    valid = [first, VALID[f"{method.full_name} items"]]
    return st.one_of(requests, requests.map(lambda chunks: [first, *chunks]), st.just(valid))


@pytest.fixture(scope="module")
def gateway(triton) -> Iterator[GatewayThread]:
    config = gateway_config(
        triton.ports.grpc_url,
        tenants=[{"name": "fuzz", "api_keys": [{"key": FUZZ_KEY}], "models": ["identity"]}],
        batch={"callback_allowlist": ["http://127.0.0.1:9/hooks/"], "max_attempts": 1},
    )
    logging.getLogger().addHandler(TRACEBACKS)
    try:
        with GatewayThread(config) as running:
            STARTED.append(time.monotonic())
            yield running
    finally:
        logging.getLogger().removeHandler(TRACEBACKS)


@pytest.fixture(scope="module")
def channel(gateway: GatewayThread) -> Iterator[grpc.Channel]:
    with grpc.insecure_channel(gateway.url) as channel:
        yield channel


# Codes seen, by RPC ("in-stream X" for answers inside a ModelStreamInfer stream).
SEEN: collections.defaultdict[str, collections.Counter[str]] = collections.defaultdict(collections.Counter)
FAILURES: list[str] = []
STARTED: list[float] = []
PROBES = collections.Counter[str]()
Metadata = tuple[tuple[str, str], ...]
AUTH: Metadata = (("authorization", f"Bearer {FUZZ_KEY}"),)
# The other headers the gateway reads, with values good and bad.
HEADERS = st.lists(
    st.tuples(
        st.sampled_from(["x-priority", "triton_grpc_error"]),
        st.sampled_from(["", "critical", "interactive", "batch", "gold", "true", "TRUE", "x" * 2000]),
    ),
    max_size=2,
).map(tuple)


def _record(method: MethodDescriptor, raw: bytes, code: grpc.StatusCode, details: str) -> None:
    SEEN[method.name][code.name] += 1
    if code not in EXPECTED:
        FAILURES.append(f"{method.full_name} {code.name} {details[:200]!r} for {raw[:80]!r}")


def _path(method: MethodDescriptor) -> str:
    return f"/{method.containing_service.full_name}/{method.name}"


def _call(channel: grpc.Channel, method: MethodDescriptor, batch: list[bytes], metadata: Metadata) -> None:
    path = _path(method)
    if method.client_streaming and method.server_streaming:
        _stream(channel, method, batch, metadata)
        return
    for raw in batch:
        try:
            if method.client_streaming:
                # A client stream: the batch's requests as chunks of one call.
                channel.stream_unary(path)(iter(batch), metadata=metadata, timeout=DEADLINE_S)
            elif method.server_streaming:
                for _ in channel.unary_stream(path)(raw, metadata=metadata, timeout=DEADLINE_S):
                    pass
            else:
                channel.unary_unary(path)(raw, metadata=metadata, timeout=DEADLINE_S)
            _record(method, raw, grpc.StatusCode.OK, "")
        except grpc.RpcError as e:
            _record(method, raw, e.code(), e.details() or "")
        if method.client_streaming:
            return


def _stream(channel: grpc.Channel, method: MethodDescriptor, batch: list[bytes], metadata: Metadata) -> None:
    """One stream carrying the batch: every request answered in it, the stream ending OK."""
    answers = []
    call = channel.stream_stream(_path(method), response_deserializer=service_pb2.ModelStreamInferResponse.FromString)
    try:
        for answer in call(iter(batch), metadata=metadata, timeout=DEADLINE_S):
            answers.append(answer)
    except grpc.RpcError as e:
        _record(method, b"<stream>", e.code(), e.details() or "")
        return
    for answer in answers:
        if answer.error_message:
            # The gateway's refusals lead with their code; Triton's own errors carry none.
            code = answer.error_message.split(":", 1)[0]
            code = code if code in grpc.StatusCode.__members__ else "Triton error"
            SEEN[method.name][f"in-stream {code}"] += 1
            if code in ("UNKNOWN", "INTERNAL"):
                FAILURES.append(f"{method.full_name} in-stream {answer.error_message[:200]!r}")
        else:
            SEEN[method.name]["in-stream OK"] += 1
    if len(answers) < len(batch):
        FAILURES.append(f"{method.full_name}: {len(batch)} requests, {len(answers)} answers: {batch!r}"[:2000])


def _still_serving(channel: grpc.Channel) -> None:
    """A valid call of each kind is served after the batch."""
    infer = channel.unary_unary(
        "/inference.GRPCInferenceService/ModelInfer", request_serializer=service_pb2.ModelInferRequest.SerializeToString
    )
    infer(identity_request(), metadata=AUTH, timeout=DEADLINE_S)
    usage = channel.unary_unary(
        "/qosgate.v1.AdminService/GetUsage", request_serializer=admin_pb2.GetUsageRequest.SerializeToString
    )
    usage(admin_pb2.GetUsageRequest(), metadata=AUTH, timeout=DEADLINE_S)
    PROBES["OK"] += 1


def _unauthenticated(channel: grpc.Channel, method: MethodDescriptor, raw: bytes) -> None:
    """Whatever the bytes, a caller with a wrong key learns nothing but UNAUTHENTICATED."""
    wrong = (("authorization", "Bearer not-a-key"),)
    try:
        if method.client_streaming and method.server_streaming:
            list(channel.stream_stream(_path(method))(iter([raw]), metadata=wrong, timeout=DEADLINE_S))
        elif method.client_streaming:
            channel.stream_unary(_path(method))(iter([raw]), metadata=wrong, timeout=DEADLINE_S)
        elif method.server_streaming:
            list(channel.unary_stream(_path(method))(raw, metadata=wrong, timeout=DEADLINE_S))
        else:
            channel.unary_unary(_path(method))(raw, metadata=wrong, timeout=DEADLINE_S)
        code = grpc.StatusCode.OK
    except grpc.RpcError as e:
        code = e.code()
    SEEN[method.name][f"wrong key: {code.name}"] += 1
    if code is not grpc.StatusCode.UNAUTHENTICATED:
        FAILURES.append(f"{method.full_name} with a wrong key: {code.name} for {raw[:80]!r}")


@pytest.mark.parametrize("name", sorted(METHODS))
def test_fuzz(channel: grpc.Channel, name: str) -> None:
    require_model("identity")
    method = METHODS[name]
    TRACEBACKS.records.clear()

    @settings(
        max_examples=BATCHES_PER_RPC,
        deadline=None,
        database=None,
        suppress_health_check=list(HealthCheck),
    )
    @given(batches_of(method), HEADERS)
    def batches(batch: list[bytes], headers: Metadata) -> None:
        FAILURES.clear()
        _call(channel, method, batch, AUTH + headers)
        _unauthenticated(channel, method, batch[0])
        assert not FAILURES, "\n".join(FAILURES)
        _still_serving(channel)

    batches()
    assert not TRACEBACKS.records, [r.getMessage() for r in TRACEBACKS.records]


def test_fuzz_summary(capsys: pytest.CaptureFixture[str]) -> None:
    """The numbers for the record; the cases ran in the tests above."""
    totals = sum(SEEN.values(), collections.Counter[str]())
    cases = sum(n for code, n in totals.items() if not code.startswith("in-stream"))
    with capsys.disabled():
        print(
            f"\nfuzz: {cases} calls over {len(SEEN)} RPCs in {time.monotonic() - STARTED[0]:.1f} s "
            f"(+{PROBES['OK']} valid probes, all served); codes: {dict(sorted(totals.items()))}"
        )
        for rpc, codes in sorted(SEEN.items()):
            print(f"  {rpc}: {dict(sorted(codes.items()))}")
    assert len(SEEN) == len(METHODS)
    assert cases >= 2 * len(METHODS) * BATCHES_PER_RPC
