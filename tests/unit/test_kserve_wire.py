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
    assert (head.model_name, head.id) == ("minilm", "req-7")


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
    expected.parameters["vllm_priority"].int64_param = 2
    expected.parameters["timeout"].int64_param = 1_500_000
    assert merged == expected


@pytest.mark.parametrize("level", [0, 1, 4, 15, 300])
def test_priority_fragment_encodes_any_level(level: int) -> None:
    merged = service_pb2.ModelInferRequest.FromString(wire.priority_fragment(level))
    assert merged.parameters["priority"].uint64_param == level
    assert merged.parameters["vllm_priority"].int64_param == level


def test_the_dispatch_fragment_sets_priority_and_timeout_over_the_callers(peek) -> None:
    raw = _request(priority=9, timeout=5, vllm_priority=0).SerializeToString()
    merged = service_pb2.ModelInferRequest.FromString(raw + wire.dispatch_fragment(2, 1500))
    assert (merged.parameters["priority"].uint64_param, merged.parameters["timeout"].int64_param) == (2, 1500)
    assert merged.parameters["vllm_priority"].int64_param == 2  # the caller's engine priority too
    untimed = service_pb2.ModelInferRequest.FromString(raw + wire.dispatch_fragment(1, None))
    assert untimed.parameters["priority"].uint64_param == 1
    assert untimed.parameters["timeout"].int64_param == 5  # the caller's, without a deadline of ours
    assert peek(raw + wire.dispatch_fragment(2, 1500)).model_name == "minilm"


def _stream_response(*, error: str = "", pad: int = 0) -> bytes:
    response = service_pb2.ModelStreamInferResponse(error_message=error)
    response.infer_response.id = "q5"
    response.infer_response.outputs.add(name="text_output", datatype="BYTES", shape=[1])
    response.infer_response.raw_output_contents.append(b"\x02\x00\x00\x00hi")
    response.infer_response.parameters["padding"].string_param = "x" * pad
    return response.SerializeToString()


@pytest.mark.parametrize("pad", [0, 8192], ids=["small", "large"])
def test_a_stream_response_that_reports_an_error_is_told_apart(pad: int) -> None:
    assert not wire.stream_response_failed(_stream_response(pad=pad))
    assert wire.stream_response_failed(_stream_response(error="boom", pad=pad))
    # Fields in another order than Triton writes them: still read.
    raw = _stream_response(pad=pad) + service_pb2.ModelStreamInferResponse(error_message="late").SerializeToString()
    assert wire.stream_response_failed(raw)
    assert not wire.stream_response_failed(b"\xff\xff")  # not ours to judge: passed on as it came


@pytest.mark.parametrize("pad", [0, 8192], ids=["small", "large"])
def test_triton_s_empty_final_response_is_told_from_one_with_outputs(pad: int) -> None:
    assert wire.stream_response_has_outputs(_stream_response(pad=pad))
    final = service_pb2.ModelStreamInferResponse()
    final.infer_response.id = "q5"
    final.infer_response.parameters["triton_final_response"].bool_param = True
    final.infer_response.parameters["padding"].string_param = "x" * pad
    assert not wire.stream_response_has_outputs(final.SerializeToString())
    assert not wire.stream_response_has_outputs(b"\xff\xff")


def _counted_response(*counts: tuple[str, int], pad: int = 0) -> service_pb2.ModelStreamInferResponse:
    """A vLLM backend's streamed response: text_output, then the count outputs asked for."""
    response = service_pb2.ModelStreamInferResponse.FromString(_stream_response(pad=pad))
    for name, value in counts:
        response.infer_response.outputs.add(name=name, datatype="UINT32", shape=[1])
        response.infer_response.raw_output_contents.append(value.to_bytes(4, "little"))
    return response


@pytest.mark.parametrize("pad", [0, 8192], ids=["small", "large"])
def test_the_engine_s_token_counts_are_read_and_the_unasked_ones_taken_out(pad: int) -> None:
    response = _counted_response(("num_input_tokens", 17), ("num_output_tokens", 3), pad=pad)
    raw = response.SerializeToString()
    prompt, generated, kept = wire.response_counts(raw, frozenset({b"num_input_tokens", b"num_output_tokens"}))
    assert (prompt, generated) == (17, 3)
    # What is left is the response the caller would have had without the flags.
    assert service_pb2.ModelStreamInferResponse.FromString(kept) == service_pb2.ModelStreamInferResponse.FromString(
        _stream_response(pad=pad)
    )
    # One taken out, the other kept with its value: outputs and values stay paired.
    prompt, generated, kept = wire.response_counts(raw, frozenset({b"num_input_tokens"}))
    assert (prompt, generated) == (17, 3)
    left = service_pb2.ModelStreamInferResponse.FromString(kept).infer_response
    assert [o.name for o in left.outputs] == ["text_output", "num_output_tokens"]
    assert list(left.raw_output_contents) == [b"\x02\x00\x00\x00hi", (3).to_bytes(4, "little")]
    assert left.parameters["padding"].string_param == "x" * pad
    # Nothing to take out: the very bytes.
    assert wire.response_counts(raw, frozenset())[2] is raw


def test_a_response_without_counts_or_not_protobuf_passes_as_it_came() -> None:
    counts = frozenset({b"num_input_tokens", b"num_output_tokens"})
    for raw in (_stream_response(), b"\xff\xff"):
        assert wire.response_counts(raw, counts) == (-1, -1, raw)
    # Values not sent raw (a reader could not pair them): read as absent, nothing taken out.
    response = _counted_response(("num_output_tokens", 3))
    del response.infer_response.raw_output_contents[:]
    raw = response.SerializeToString()
    assert wire.response_counts(raw, counts) == (-1, -1, raw)


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
    assert peek(_VALID).model_name == "minilm"


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
    key = b"triton_enable_empty_final_response"
    entry = b"\x0a" + bytes([len(key)]) + key + b"\x12\xca\x01" + b"\x78\x01" * 100 + b"\x08\x01"
    raw = service_pb2.ModelInferRequest(model_name="identity").SerializeToString()
    raw += b"\x22" + bytes([len(entry) & 0x7F | 0x80, len(entry) >> 7]) + entry
    assert service_pb2.ModelInferRequest.FromString(raw).parameters[key.decode()].bool_param
    assert wire.peek_request(raw, 500).model_name == "identity"
    with pytest.raises(wire.TooManyFields):
        wire.peek_request(raw, 50)


def test_a_real_request_fits_the_default_budget_with_room() -> None:
    request = _request(triton_enable_empty_final_response=True)
    for i in range(500):  # 500 tensors: two top-level fields each
        request.inputs.add(name=f"IN{i}", datatype="FP32", shape=[1])
        request.raw_input_contents.append(b"\x00" * 4)
    assert wire.peek_request(request.SerializeToString(), MAX_FIELDS).model_name == "minilm"


def test_text_past_the_bound_is_refused_whatever_its_depth() -> None:
    """Triton quotes request text in its status header: one over nghttp2's field bound
    would end the gateway's connection to it, so no such text is passed on."""
    long = "9" * (wire.MAX_STRING_BYTES + 1)
    for request in (
        service_pb2.ModelInferRequest(model_name="m", model_version=long),
        _request(**{"k": long}),  # a string parameter, inside the parameters map
    ):
        with pytest.raises(wire.WireError, match="over the limit"):
            wire.peek_request(request.SerializeToString(), MAX_FIELDS)
    fits = service_pb2.ModelInferRequest(model_name="m", model_version="9" * wire.MAX_STRING_BYTES)
    assert wire.peek_request(fits.SerializeToString(), MAX_FIELDS).model_name == "m"
    statistics = service_pb2.ModelStatisticsRequest(name="identity", version=long)
    with pytest.raises(wire.WireError, match="over the limit"):
        wire.check_text(statistics.SerializeToString(), statistics.DESCRIPTOR, MAX_FIELDS)
    wire.check_text(service_pb2.ModelStatisticsRequest(name="identity").SerializeToString(), statistics.DESCRIPTOR, MAX_FIELDS)
