"""Just enough of the protobuf wire format to route KServe inference messages as bytes.

The gateway never decodes tensors: it reads the few top-level fields it routes on
(model name, request id, batch rows) straight from the serialized ModelInferRequest
(and whether a ModelStreamInferResponse reports an error; of an LLM's response under
`kserve_token_counts`, the engine's token counts, whose outputs it may also take out:
`response_counts`), and changes a request by APPENDING an encoded fragment. Protobuf
parsers merge concatenated messages: a later scalar replaces an earlier one, a later map
entry replaces the entry with the same key. So `original + fragment` is the original
request with our `priority`, `vllm_priority` and `timeout` parameters overriding whatever
the caller set, without copying or re-encoding the tensors (tests check this against the
real protobuf runtime).

A request is also checked the way Triton's parser will check it (well-formed fields at
every level, UTF-8 in every string, whole elements in packed fields) before it is
forwarded: Triton answers a unary request it cannot parse with INTERNAL, and ends a whole
ModelStreamInfer stream at one, silently dropping the requests after it.

Field numbers are from KServe v2's grpc_service.proto (tritonclient.grpc.service_pb2).
The two field encoders (`len_field`, `varint_field`) also write the one part of a refusal's
google.rpc.Status that differs per call, its RetryInfo (transport/status.py).
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field

from google.protobuf.descriptor import Descriptor, FieldDescriptor
from google.protobuf.message import DecodeError
from tritonclient.grpc import service_pb2

from qosgate.kserve.names import ENGINE_PRIORITY_PARAMETER

# ModelInferRequest / ModelInferResponse
_MODEL_NAME = 1
_ID = 3
_PARAMETERS = 4
_REQUEST_INPUTS = 5
_RESPONSE_OUTPUTS = 5
_RESPONSE_RAW_OUTPUTS = 6
# InferInputTensor / InferOutputTensor
_TENSOR_NAME = 1
_INPUT_SHAPE = 3
# ModelStreamInferResponse
_STREAM_ERROR = 1
_STREAM_RESPONSE = 2
# InferParameter (a oneof)
_INT64_PARAM = 2
_UINT64_PARAM = 5
# map<string, InferParameter> entry
_KEY = 1
_VALUE = 2

_VARINT, _I64, _LEN, _I32 = 0, 1, 2, 5


class WireError(ValueError):
    """The bytes are not a well-formed protobuf message."""


def _read_varint(buf: bytes | memoryview, pos: int) -> tuple[int, int]:
    result = 0
    shift = 0
    while True:
        if pos >= len(buf):
            raise WireError("truncated varint")
        byte = buf[pos]
        pos += 1
        result |= (byte & 0x7F) << shift
        if byte < 0x80:
            return result, pos
        shift += 7
        if shift > 63:
            raise WireError("varint too long")


def _skip(buf: bytes | memoryview, pos: int, wire_type: int) -> int:
    if wire_type == _VARINT:
        return _read_varint(buf, pos)[1]
    if wire_type == _LEN:
        length, pos = _read_varint(buf, pos)
        end = pos + length
        if end > len(buf):
            raise WireError("truncated length-delimited field")
        return end
    if wire_type == _I64:
        return pos + 8
    if wire_type == _I32:
        return pos + 4
    raise WireError(f"unsupported wire type {wire_type}")


class TooManyFields(WireError):
    """The message has more fields than the caller's budget allows."""


class _FieldBudget:
    """Fields left to visit in one message, nested messages included: the cost of reading
    a request is bounded by this, not by how finely its bytes were split into fields."""

    __slots__ = ("limit", "left")

    def __init__(self, limit: int) -> None:
        self.limit = limit
        self.left = limit

    def spend(self) -> None:
        self.left -= 1
        if self.left < 0:
            raise TooManyFields(f"more than {self.limit} fields")


def _fields(buf: bytes | memoryview, budget: _FieldBudget | None = None):
    """Yield (field number, wire type, start, end) of each top-level field.

    For length-delimited fields start/end bound the payload; for others, the raw value
    bytes (a varint is decoded by the caller when it cares). `budget`, when given, is
    charged one per field.
    """
    pos = 0
    size = len(buf)
    while pos < size:
        if budget is not None:
            budget.spend()
        key, pos = _read_varint(buf, pos)
        number, wire_type = key >> 3, key & 7
        if number == 0 or key >> 32:
            raise WireError("invalid field number")
        if wire_type == _LEN:
            length, pos = _read_varint(buf, pos)
            end = pos + length
            if end > size:
                raise WireError("truncated length-delimited field")
            yield number, wire_type, pos, end
            pos = end
        else:
            end = _skip(buf, pos, wire_type)
            yield number, wire_type, pos, end
            pos = end
    if pos != size:
        raise WireError("truncated message")


# What the protobuf runtime checks in a field it knows, by type; other types need nothing
# beyond the well-formed framing that `_fields` checks.
_PACKED_SIZES = {
    **dict.fromkeys(
        (
            FieldDescriptor.TYPE_INT32,
            FieldDescriptor.TYPE_INT64,
            FieldDescriptor.TYPE_UINT32,
            FieldDescriptor.TYPE_UINT64,
            FieldDescriptor.TYPE_SINT32,
            FieldDescriptor.TYPE_SINT64,
            FieldDescriptor.TYPE_BOOL,
            FieldDescriptor.TYPE_ENUM,
        ),
        0,  # varints
    ),
    **dict.fromkeys(
        (FieldDescriptor.TYPE_FIXED32, FieldDescriptor.TYPE_SFIXED32, FieldDescriptor.TYPE_FLOAT), 4
    ),
    **dict.fromkeys(
        (FieldDescriptor.TYPE_FIXED64, FieldDescriptor.TYPE_SFIXED64, FieldDescriptor.TYPE_DOUBLE), 8
    ),
}
# A varint is at most 10 bytes: 10 continuation bytes in a row make a packed field invalid.
_OVERLONG_VARINT = re.compile(rb"[\x80-\xff]{10}")


@dataclass(slots=True)
class _Schema:
    """The length-delimited fields of one message type that its parser looks inside."""

    strings: frozenset[int]
    packed: dict[int, int]  # field number -> element size (0: varints)
    messages: dict[int, _Schema] = field(default_factory=dict)


def _schema(descriptor: Descriptor) -> _Schema:
    # KServe's request types are not recursive, so plain recursion ends.
    return _Schema(
        strings=frozenset(f.number for f in descriptor.fields if f.type == FieldDescriptor.TYPE_STRING),
        packed={
            f.number: _PACKED_SIZES[f.type]
            for f in descriptor.fields
            if f.is_repeated and f.type in _PACKED_SIZES
        },
        messages={f.number: _schema(f.message_type) for f in descriptor.fields if f.message_type},
    )


_INFER_REQUEST = _schema(service_pb2.ModelInferRequest.DESCRIPTOR)
# The longest text field of a request passed on to Triton. Triton quotes request values in
# its error messages, percent-encoded (up to 3 bytes a byte) in its grpc-message header;
# one header field over nghttp2's bound (64 KiB, not configurable) ends the gateway's whole
# connection to that Triton with a COMPRESSION_ERROR, every call on it with it.
MAX_STRING_BYTES = 16 << 10


def _check_field(
    buf: bytes | memoryview, start: int, end: int, number: int, schema: _Schema, budget: _FieldBudget
) -> None:
    """Raise WireError where the protobuf runtime would refuse field `number`'s payload."""
    if number in schema.strings:
        if end - start > MAX_STRING_BYTES:
            raise WireError(f"field {number} holds {end - start} bytes of text, over the limit of {MAX_STRING_BYTES}")
        try:
            str(buf[start:end], "utf-8")
        except UnicodeDecodeError:
            raise WireError(f"field {number} is not valid UTF-8") from None
        return
    nested = schema.messages.get(number)
    if nested is not None:
        _check(memoryview(buf)[start:end], nested, budget)
        return
    size = schema.packed.get(number)
    if size is None:
        return
    if size:
        if (end - start) % size:
            raise WireError(f"packed field {number} holds a partial element")
    elif end > start and (buf[end - 1] >= 0x80 or _OVERLONG_VARINT.search(buf, start, end)):
        raise WireError(f"packed field {number} holds an invalid varint")


def _check(buf: memoryview, schema: _Schema, budget: _FieldBudget) -> None:
    for number, wire_type, start, end in _fields(buf, budget):
        if wire_type == _LEN:
            _check_field(buf, start, end, number, schema, budget)


class InferRequestHead:
    """The routing fields of a ModelInferRequest (last occurrence wins, as in protobuf).

    Of a message the protobuf runtime parsed, the fields but the model name are read when
    first asked for: a unary call reads the model name alone (and its batch rows only
    under the `text` cost), and each read through the runtime costs several microseconds
    with the cold caches a call at low concurrency meets."""

    __slots__ = ("model_name", "_request", "_id", "_rows")

    def __init__(
        self,
        model_name: str = "",
        *,
        id: str = "",  # noqa: A002 - the protobuf field's name
        rows: int = 1,
        request: service_pb2.ModelInferRequest | None = None,
    ) -> None:
        self.model_name = model_name
        self._request = request
        self._id: str | None = id if request is None else None
        self._rows: int | None = rows if request is None else None

    def fields(self) -> tuple[str, str, int]:
        """(model_name, id, rows), each read."""
        return self.model_name, self.id, self.rows

    def __eq__(self, other: object) -> bool:
        return isinstance(other, InferRequestHead) and self.fields() == other.fields()

    __hash__ = None  # type: ignore[assignment]  # equal by its fields, which may be read late

    def __repr__(self) -> str:
        return "InferRequestHead(model_name={!r}, id={!r}, rows={!r})".format(*self.fields())

    @property
    def id(self) -> str:
        if self._id is None:
            assert self._request is not None
            self._id = self._request.id
        return self._id

    @property
    def rows(self) -> int:
        """The first dimension of the first input's shape: the batch size (the `text` cost)."""
        if self._rows is None:
            assert self._request is not None
            self._rows = 1
            inputs = self._request.inputs
            if inputs:
                shape = inputs[0].shape
                if shape:
                    self._rows = shape[0] % (1 << 64)  # as the walk reads it: unsigned
        return self._rows


def peek_request(buf: bytes | memoryview, max_fields: int) -> InferRequestHead:
    """Read model_name, id and the batch rows, and check
    the whole request as Triton's parser would (WireError where it would refuse it); tensor
    bytes are skipped.

    Every field is visited (a later model_name would win at Triton, so none may be
    missed), at most `max_fields` of them, nested ones included: a message made of more
    raises TooManyFields after that many steps, whatever its size.

    A message of at most 2 x `max_fields` bytes cannot hold more (each field takes a tag
    byte and at least one value byte, a nested one inside its parent's payload), nor one
    of MAX_STRING_BYTES a text field longer than that: the protobuf runtime (upb, in C)
    reads it, about 25x faster than the walk here and by definition as strictly as
    Triton's parser. Larger ones are walked under the budget, text fields bounded.
    """
    if len(buf) <= min(2 * max_fields, MAX_STRING_BYTES):
        try:
            request = service_pb2.ModelInferRequest.FromString(buf)
        except DecodeError as e:
            raise WireError(str(e)) from None
        return InferRequestHead(request.model_name, request=request)
    budget = _FieldBudget(max_fields)
    model_name = request_id = ""
    rows = 1
    first_input = True
    for number, wire_type, start, end in _fields(buf, budget):
        if wire_type != _LEN:
            continue
        _check_field(buf, start, end, number, _INFER_REQUEST, budget)
        if number == _REQUEST_INPUTS and first_input:
            first_input = False
            rows = _first_dimension(buf[start:end], rows, budget)
        elif number == _MODEL_NAME:
            model_name = str(buf[start:end], "utf-8")
        elif number == _ID:
            request_id = str(buf[start:end], "utf-8")
    return InferRequestHead(model_name, id=request_id, rows=rows)


def _first_dimension(tensor: bytes | memoryview, default: int, budget: _FieldBudget) -> int:
    """shape[0] of an InferInputTensor (packed or not), or `default` if it has no shape."""
    for number, wire_type, start, end in _fields(tensor, budget):
        if number != _INPUT_SHAPE:
            continue
        if wire_type == _LEN:
            return _read_varint(tensor, start)[0] if end > start else default
        if wire_type == _VARINT:
            return _read_varint(tensor, start)[0]
    return default


_ONE_BYTE = [bytes((value,)) for value in range(0x80)]


def _varint(value: int) -> bytes:
    # Only non-negative values are ever encoded here (levels, lengths, microseconds).
    if value < 0x80:  # tags and most lengths: one byte
        return _ONE_BYTE[value]
    out = bytearray()
    while value >= 0x80:
        out.append((value & 0x7F) | 0x80)
        value >>= 7
    out.append(value)
    return bytes(out)


def len_field(number: int, payload: bytes) -> bytes:
    """Field `number` of a message: length-delimited `payload` (bytes, string, message)."""
    return _varint((number << 3) | _LEN) + _varint(len(payload)) + payload


def varint_field(number: int, value: int) -> bytes:
    """Field `number` of a message: a non-negative integer as a varint."""
    return _varint((number << 3) | _VARINT) + _varint(value)


def _parameter(key: str, param_number: int, value: int) -> bytes:
    entry = len_field(_KEY, key.encode()) + len_field(_VALUE, varint_field(param_number, value))
    return len_field(_PARAMETERS, entry)


# Precomputed per level: the scheduler hands out a handful of levels, so the hot path
# only concatenates bytes.
def _priority(level: int) -> bytes:
    return _parameter("priority", _UINT64_PARAM, level) + _parameter(ENGINE_PRIORITY_PARAMETER, _INT64_PARAM, level)


_PRIORITY_FRAGMENTS = {level: _priority(level) for level in range(16)}


def priority_fragment(level: int) -> bytes:
    """Sets Triton's request `priority` (uint64; 1 is the highest level, 0 the model
    default) and the same level as the engine priority our vLLM backend reads."""
    fragment = _PRIORITY_FRAGMENTS.get(level)
    return fragment if fragment is not None else _priority(level)


def timeout_fragment(timeout_us: int) -> bytes:
    """Sets Triton's request `timeout` (int64 microseconds; Triton's queue policy applies it)."""
    return _parameter("timeout", _INT64_PARAM, max(1, timeout_us))


def dispatch_fragment(level: int, timeout_us: int | None) -> bytes:
    """The bytes appended to a request at dispatch: Triton's priority `level`, and its
    timeout when the call has a deadline."""
    fragment = priority_fragment(level)
    return fragment if timeout_us is None else fragment + timeout_fragment(timeout_us)


def stream_response_failed(buf: bytes) -> bool:
    """Whether a ModelStreamInferResponse reports its request failed (`error_message`
    set). Only its top-level fields are walked: two, the response skipped whole."""
    try:
        for number, wire_type, start, end in _fields(buf):
            if number == _STREAM_ERROR and wire_type == _LEN and end > start:
                return True
    except WireError:
        return False  # not ours to judge: it goes to the caller as Triton wrote it
    return False


def stream_response_has_outputs(buf: bytes) -> bool:
    """Whether a ModelStreamInferResponse's response carries output tensors (Triton's
    empty final response carries none). Its response's fields are walked, the tensors
    skipped whole."""
    try:
        for number, wire_type, start, end in _fields(buf):
            if number == _STREAM_RESPONSE and wire_type == _LEN:
                for inner, inner_type, _, _ in _fields(memoryview(buf)[start:end]):
                    if inner == _RESPONSE_OUTPUTS and inner_type == _LEN:
                        return True
    except WireError:
        pass  # not ours to judge
    return False


_NUM_INPUT_TOKENS = b"num_input_tokens"
_NUM_OUTPUT_TOKENS = b"num_output_tokens"


def response_counts(buf: bytes, strip: frozenset[bytes]) -> tuple[int, int, bytes]:
    """The engine's token counts in a ModelStreamInferResponse of the vLLM contract: its
    `num_input_tokens` and `num_output_tokens` outputs (UINT32 [1], in raw_output_contents,
    as Triton sends every output), -1 where absent; and the message with the outputs named
    in `strip` and their values taken out (the very bytes when there are none)."""
    try:
        before = 0
        for number, wire_type, start, end in _fields(buf):
            if number == _STREAM_RESPONSE and wire_type == _LEN:
                prompt, generated, kept = _counts(memoryview(buf)[start:end], strip)
                if kept is None:
                    return prompt, generated, buf
                return prompt, generated, buf[:before] + len_field(_STREAM_RESPONSE, kept) + buf[end:]
            before = end
    except WireError:
        pass  # not ours to judge: it goes to the caller as Triton wrote it
    return -1, -1, buf


def _counts(response: memoryview, strip: frozenset[bytes]) -> tuple[int, int, bytes | None]:
    # Outputs and their raw values pair up by order, each kind counted on its own.
    outputs: list[tuple[int, int, bytes]] = []  # (field start, end, name)
    values: list[tuple[int, int, int]] = []  # (field start, value start, end)
    before = 0
    for number, wire_type, start, end in _fields(response):
        if wire_type == _LEN:
            if number == _RESPONSE_OUTPUTS:
                outputs.append((before, end, _tensor_name(response[start:end])))
            elif number == _RESPONSE_RAW_OUTPUTS:
                values.append((before, start, end))
        before = end
    prompt = generated = -1
    if len(values) != len(outputs):
        return prompt, generated, None  # values not sent raw: nothing here reads them
    dropped: list[tuple[int, int]] = []
    for (output_start, output_end, name), (value_start, start, end) in zip(outputs, values):
        if name != _NUM_INPUT_TOKENS and name != _NUM_OUTPUT_TOKENS:
            continue
        if end - start == 4:
            count = int.from_bytes(response[start:end], "little")
            if name == _NUM_INPUT_TOKENS:
                prompt = count
            else:
                generated = count
        if name in strip:
            dropped.append((output_start, output_end))
            dropped.append((value_start, end))
    if not dropped:
        return prompt, generated, None
    dropped.sort()
    kept = bytearray()
    at = 0
    for start, end in dropped:
        kept += response[at:start]
        at = end
    kept += response[at:]
    return prompt, generated, bytes(kept)


def _tensor_name(tensor: memoryview) -> bytes:
    name = b""
    for number, wire_type, start, end in _fields(tensor):
        if number == _TENSOR_NAME and wire_type == _LEN:
            name = bytes(tensor[start:end])
    return name


def check_text(raw: bytes, descriptor: Descriptor, max_fields: int) -> None:
    """Raise WireError when a request of `descriptor`'s type (one the runtime parsed)
    holds a text field longer than MAX_STRING_BYTES, at any depth (see there)."""
    if len(raw) > MAX_STRING_BYTES:
        _check(memoryview(raw), _schemas(descriptor), _FieldBudget(max_fields))


_SCHEMAS: dict[str, _Schema] = {}


def _schemas(descriptor: Descriptor) -> _Schema:
    schema = _SCHEMAS.get(descriptor.full_name)
    if schema is None:
        schema = _SCHEMAS[descriptor.full_name] = _schema(descriptor)
    return schema
