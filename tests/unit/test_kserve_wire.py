"""The byte-level reader/appender against the real protobuf runtime (merge semantics)."""

from __future__ import annotations

import numpy as np
import pytest
from google.protobuf.message import DecodeError
from hypothesis import given, settings
from hypothesis import strategies as st
from tritonclient.grpc import service_pb2

from qosgate.kserve import wire

MAX_FIELDS = 4096
# An unknown length-delimited field (15) of 2 x MAX_FIELDS bytes: put in front of a request
# it changes nothing a parser reads, and makes the message too large for peek_request's
# parsed path, so the same case runs through the budgeted walk.
_PADDING = b"\x7a" + bytes([(2 * MAX_FIELDS) & 0x7F | 0x80, (2 * MAX_FIELDS) >> 7]) + b"\x00" * (2 * MAX_FIELDS)


@pytest.fixture(params=["parsed", "walked", "parsed view", "walked view"])
def peek(request: pytest.FixtureRequest):
    """peek_request by each of its two paths (small messages parsed, large ones walked),
    on bytes and on a view into a larger buffer (how the relay hands over a first message)."""
    padding = _PADDING if request.param.startswith("walked") else b""
    if request.param.endswith("view"):
        return lambda raw: wire.peek_request(memoryview(b"\x00" * 5 + padding + raw)[5:], MAX_FIELDS)
    return lambda raw: wire.peek_request(padding + raw, MAX_FIELDS)


def _request(**params: object) -> service_pb2.ModelInferRequest:
    request = service_pb2.ModelInferRequest(model_name="minilm", model_version="1", id="req-7")
    tensor = request.inputs.add(name="INPUT0", datatype="FP32", shape=[1, 4])
    del tensor
    request.raw_input_contents.append(np.arange(4, dtype=np.float32).tobytes())
    for key, value in params.items():
        if isinstance(value, bool):
            request.parameters[key].bool_param = value
        elif isinstance(value, int):
            request.parameters[key].int64_param = value
        else:
            request.parameters[key].string_param = str(value)
    return request


def test_peek_reads_routing_fields_and_skips_tensors(peek) -> None:
    raw = _request(triton_enable_empty_final_response=True, other="x").SerializeToString()
    head = peek(raw)
    assert (head.model_name, head.id, head.wants_empty_final) == ("minilm", "req-7", True)


def test_peek_reads_the_batch_rows_of_the_first_input(peek) -> None:
    assert peek(_request().SerializeToString()).rows == 1
    request = service_pb2.ModelInferRequest(model_name="minilm")
    request.inputs.add(name="text", datatype="BYTES", shape=[300, 1])
    request.inputs.add(name="other", datatype="BYTES", shape=[7])
    assert peek(request.SerializeToString()).rows == 300
    # No shape (or no input): one row.
    assert peek(service_pb2.ModelInferRequest(model_name="m").SerializeToString()).rows == 1


def test_peek_last_occurrence_wins_like_protobuf(peek) -> None:
    raw = _request().SerializeToString() + service_pb2.ModelInferRequest(
        model_name="identity"
    ).SerializeToString()
    assert peek(raw).model_name == "identity"
    assert service_pb2.ModelInferRequest.FromString(raw).model_name == "identity"


def test_appended_priority_and_timeout_override_the_callers() -> None:
    original = _request(priority=9, timeout=5, keep="me")
    raw = (
        original.SerializeToString()
        + wire.priority_fragment(2)
        + wire.timeout_fragment(1_500_000)
    )
    merged = service_pb2.ModelInferRequest.FromString(raw)
    # The caller's int64 priority is replaced by ours (uint64, as tritonclient sends it).
    assert merged.parameters["priority"].WhichOneof("parameter_choice") == "uint64_param"
    assert merged.parameters["priority"].uint64_param == 2
    assert merged.parameters["timeout"].int64_param == 1_500_000
    # Everything else is untouched, tensors included.
    assert merged.parameters["keep"].string_param == "me"
    expected = service_pb2.ModelInferRequest()
    expected.CopyFrom(original)
    expected.parameters["priority"].uint64_param = 2
    expected.parameters["timeout"].int64_param = 1_500_000
    assert merged == expected


@pytest.mark.parametrize("level", [0, 1, 4, 15, 300])
def test_priority_fragment_encodes_any_level(level: int) -> None:
    merged = service_pb2.ModelInferRequest.FromString(wire.priority_fragment(level))
    assert merged.parameters["priority"].uint64_param == level


def test_id_and_empty_final_fragments(peek) -> None:
    raw = _request().SerializeToString() + wire.id_fragment("q1") + wire.empty_final_fragment()
    merged = service_pb2.ModelInferRequest.FromString(raw)
    assert merged.id == "q1"
    assert merged.parameters["triton_enable_empty_final_response"].bool_param is True
    assert peek(raw).id == "q1"


# A stream response is read by the protobuf runtime up to 4 KiB and walked above: each
# case runs both ways, the padding (an output's bytes) making the response large.
SIZES = pytest.mark.parametrize("pad", [0, 8192], ids=["small", "large"])


def _stream_response(*, final: bool, outputs: bool = True, error: str = "", pad: int = 0) -> bytes:
    response = service_pb2.ModelStreamInferResponse(error_message=error)
    response.infer_response.id = "q5"
    response.infer_response.model_name = "smollm2"
    if outputs:
        response.infer_response.outputs.add(name="text_output", datatype="BYTES", shape=[1])
        response.infer_response.raw_output_contents.append(b"\x02\x00\x00\x00hi")
    response.infer_response.parameters["triton_final_response"].bool_param = final
    response.infer_response.parameters["padding"].string_param = "x" * pad
    return response.SerializeToString()


@SIZES
def test_peek_stream_response_final_flag_and_outputs(pad: int) -> None:
    head = wire.peek_stream_response(_stream_response(final=False, pad=pad))
    assert (head.id, head.is_final, head.has_outputs, head.is_error) == ("q5", False, True, False)
    head = wire.peek_stream_response(_stream_response(final=True, outputs=False, pad=pad))
    assert (head.is_final, head.has_outputs) == (True, False)


@SIZES
def test_an_error_response_is_final(pad: int) -> None:
    raw = service_pb2.ModelStreamInferResponse(
        error_message="boom", infer_response=service_pb2.ModelInferResponse(id="q9")
    ).SerializeToString() + wire.len_field(2, wire.len_field(8, b"x" * pad))
    head = wire.peek_stream_response(raw)
    assert (head.id, head.is_error, head.is_final) == ("q9", True, True)


def test_a_response_the_runtime_refuses_is_walked() -> None:
    """An id that is not UTF-8 makes the protobuf runtime refuse the message; the walk reads it."""
    raw = _stream_response(final=True) + wire.len_field(2, wire.len_field(3, b"q\xff"))
    head = wire.peek_stream_response(raw)
    assert (head.id, head.is_final) == ("q\ufffd", True)


def test_stream_response_id_is_set_inside_the_one_infer_response() -> None:
    original = _stream_response(final=True)
    raw = wire.with_stream_response_id(original, "client-1")
    parsed = service_pb2.ModelStreamInferResponse.FromString(raw)
    assert parsed.infer_response.id == "client-1"
    assert parsed.infer_response.model_name == "smollm2"
    assert parsed.infer_response.raw_output_contents[0] == b"\x02\x00\x00\x00hi"
    # One infer_response field: a parser that keeps the last occurrence of an embedded
    # message (protobuf.js) sees the whole response too.
    fields = [number for number, _type, _start, _end in wire._fields(raw)]
    assert fields.count(2) == 1
    expected = service_pb2.ModelStreamInferResponse.FromString(original)
    expected.infer_response.id = "client-1"
    assert parsed == expected


def test_stream_response_id_after_other_fields() -> None:
    """Not the usual layout (infer_response alone): the message is written again around it."""
    original = service_pb2.ModelStreamInferResponse(
        error_message="", infer_response=service_pb2.ModelInferResponse(id="q", model_name="m")
    ).SerializeToString()
    unknown_field = wire.varint_field(15, 7)  # a field of a newer Triton, kept as it came
    raw = wire.with_stream_response_id(unknown_field + original, "c3")
    parsed = service_pb2.ModelStreamInferResponse.FromString(raw)
    assert (parsed.infer_response.id, parsed.infer_response.model_name) == ("c3", "m")
    assert raw.startswith(unknown_field)


def test_an_error_response_gets_its_id_too() -> None:
    raw = service_pb2.ModelStreamInferResponse(error_message="boom").SerializeToString()
    parsed = service_pb2.ModelStreamInferResponse.FromString(wire.with_stream_response_id(raw, "c2"))
    assert (parsed.error_message, parsed.infer_response.id) == ("boom", "c2")


def test_truncated_bytes_are_rejected(peek) -> None:
    raw = _request().SerializeToString()
    with pytest.raises(wire.WireError):
        peek(raw[:-3])


def _rich_request() -> bytes:
    """A request using every kind of field the check looks inside."""
    request = _request(triton_enable_empty_final_response=True, name="x")
    tensor = request.inputs.add(name="INPUT1", datatype="INT64", shape=[3])
    tensor.parameters["p"].string_param = "v"
    tensor.contents.int64_contents.extend([1, -5, 2**40])
    tensor.contents.fp32_contents.extend([1.0, 2.0])
    tensor.contents.bytes_contents.append(b"\xff raw bytes need not be text")
    request.outputs.add(name="OUT").parameters["q"].bool_param = True
    return request.SerializeToString()


@pytest.mark.parametrize(
    "raw",
    [
        b"\x0a\x02\xff\xfe",  # model_name not UTF-8
        b"\x1a\x03\xed\xa0\x80",  # id holding a UTF-16 surrogate
        b"\x2a\x04\x0a\x02\xc3\x28",  # inputs[0].name not UTF-8
        b"\x22\x06\x0a\x04\x80\x80\x80\x80",  # a parameters key not UTF-8
        b"\x2a\x03\x1a\x01\x80",  # inputs[0].shape: a packed varint cut short
        b"\x2a\x05\x2a\x03\x32\x01\x00",  # inputs[0].contents.fp32_contents: 1 byte of a float
        b"\x2a\x02\x0a\x05",  # inputs[0]: a field longer than its message
        b"\x00\x01",  # field number 0
    ],
)
def test_requests_the_protobuf_runtime_refuses_are_refused(raw: bytes, peek) -> None:
    with pytest.raises(DecodeError):
        service_pb2.ModelInferRequest.FromString(raw)
    with pytest.raises(wire.WireError):
        peek(raw)


_VALID = _rich_request()
_EDITS = st.lists(
    st.tuples(st.sampled_from(["set", "insert", "delete"]), st.integers(0, len(_VALID) - 1), st.integers(0, 255)),
    min_size=1,
    max_size=4,
)


def test_the_rich_request_passes(peek) -> None:
    assert peek(_VALID).wants_empty_final


@settings(max_examples=500, deadline=None, database=None)
@given(_EDITS)
def test_mutated_requests_are_refused_whenever_the_protobuf_runtime_refuses_them(
    edits: list[tuple[str, int, int]],
) -> None:
    raw = bytearray(_VALID)
    for op, at, value in edits:
        at = min(at, len(raw) - 1)
        if op == "set":
            raw[at] = value
        elif op == "insert":
            raw.insert(at, value)
        else:
            del raw[at]
    try:
        parsed = service_pb2.ModelInferRequest.FromString(bytes(raw))
    except DecodeError:
        # What Triton's parser would refuse must never be forwarded, by either path.
        for padding in (b"", _PADDING):
            with pytest.raises(wire.WireError):
                wire.peek_request(padding + bytes(raw), MAX_FIELDS)
        return
    # What it accepts, both paths read alike (the walk may refuse more: groups, which
    # the runtime skips as unknown fields, it does not read).
    heads = []
    for padding in (b"", _PADDING):
        try:
            heads.append(wire.peek_request(padding + bytes(raw), MAX_FIELDS))
        except wire.WireError:
            continue
    assert all(head == heads[0] for head in heads)
    assert heads[0].model_name == parsed.model_name


def test_field_budget_bounds_the_work_on_a_crafted_request() -> None:
    # 1M one-byte varint fields (model_version would be field 2; 15 is unknown): the
    # reader stops after the budget instead of walking them all.
    crafted = service_pb2.ModelInferRequest(model_name="identity").SerializeToString()
    crafted += b"\x78\x01" * 1_000_000
    with pytest.raises(wire.TooManyFields, match="more than 4096 fields"):
        wire.peek_request(crafted, MAX_FIELDS)


def test_field_budget_counts_fields_inside_parameters() -> None:
    # A parameters entry whose value holds many fields spends the same budget.
    key = wire.EMPTY_FINAL_PARAM.encode()
    entry = b"\x0a" + bytes([len(key)]) + key + b"\x12\xca\x01" + b"\x78\x01" * 100 + b"\x08\x01"
    raw = service_pb2.ModelInferRequest(model_name="identity").SerializeToString()
    raw += b"\x22" + bytes([len(entry) & 0x7F | 0x80, len(entry) >> 7]) + entry
    assert service_pb2.ModelInferRequest.FromString(raw).parameters[wire.EMPTY_FINAL_PARAM].bool_param
    assert wire.peek_request(raw, 500).model_name == "identity"
    with pytest.raises(wire.TooManyFields):
        wire.peek_request(raw, 50)


def test_a_real_request_fits_the_default_budget_with_room() -> None:
    request = _request(triton_enable_empty_final_response=True)
    for i in range(500):  # 500 tensors: two top-level fields each
        request.inputs.add(name=f"IN{i}", datatype="FP32", shape=[1])
        request.raw_input_contents.append(b"\x00" * 4)
    assert wire.peek_request(request.SerializeToString(), MAX_FIELDS).model_name == "minilm"
