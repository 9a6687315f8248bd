"""Just enough of the protobuf wire format to route KServe inference messages as bytes.

The gateway never decodes tensors: it reads the few top-level fields it routes on
(model name, request id, a handful of parameters) straight from the serialized
ModelInferRequest / ModelStreamInferResponse, and changes a message by APPENDING an
encoded fragment. Protobuf parsers merge concatenated messages: a later scalar replaces
an earlier one, a later map entry replaces the entry with the same key, and a later
embedded message merges into the earlier one. So `original + fragment` is the original
request with our `priority`/`timeout` parameters (or id) overriding whatever the caller
set, without copying or re-encoding the tensors (tests check this against the real
protobuf runtime).

A request is also checked the way Triton's parser will check it (well-formed fields at
every level, UTF-8 in every string, whole elements in packed fields) before it is
forwarded: Triton answers a unary request it cannot parse with INTERNAL, and ends a whole
ModelStreamInfer stream at one, silently dropping the requests after it.

Field numbers are from KServe v2's grpc_service.proto (tritonclient.grpc.service_pb2).
The two field encoders (`len_field`, `varint_field`) also write the one part of a refusal's
google.rpc.Status that differs per call, its RetryInfo (services/status.py).
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field

from google.protobuf.descriptor import Descriptor, FieldDescriptor
from google.protobuf.message import DecodeError
from tritonclient.grpc import service_pb2

# ModelInferRequest / ModelInferResponse
_MODEL_NAME = 1
_ID = 3
_PARAMETERS = 4
_REQUEST_INPUTS = 5
_RESPONSE_OUTPUTS = 5
# InferInputTensor
_INPUT_SHAPE = 3
# ModelStreamInferResponse
_STREAM_ERROR = 1
_STREAM_INFER_RESPONSE = 2
# InferParameter (a oneof)
_BOOL_PARAM = 1
_INT64_PARAM = 2
_UINT64_PARAM = 5
# map<string, InferParameter> entry
_KEY = 1
_VALUE = 2

_VARINT, _I64, _LEN, _I32 = 0, 1, 2, 5

FINAL_RESPONSE_PARAM = "triton_final_response"
EMPTY_FINAL_PARAM = "triton_enable_empty_final_response"


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


def _map_entry_key(buf: bytes | memoryview, budget: _FieldBudget | None = None) -> str:
    for number, wire_type, start, end in _fields(buf, budget):
        if number == _KEY and wire_type == _LEN:
            return str(buf[start:end], "utf-8", "replace")
    return ""


def _map_entry_bool(buf: bytes | memoryview, budget: _FieldBudget | None = None) -> bool | None:
    """The bool_param of a map<string, InferParameter> entry's value, if it is one."""
    for number, wire_type, start, end in _fields(buf, budget):
        if number == _VALUE and wire_type == _LEN:
            value = buf[start:end]
            for vnumber, vtype, vstart, _ in _fields(value, budget):
                if vnumber == _BOOL_PARAM and vtype == _VARINT:
                    return _read_varint(value, vstart)[0] != 0
    return None


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


def _check_field(
    buf: bytes | memoryview, start: int, end: int, number: int, schema: _Schema, budget: _FieldBudget
) -> None:
    """Raise WireError where the protobuf runtime would refuse field `number`'s payload."""
    if number in schema.strings:
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

    __slots__ = ("model_name", "_request", "_id", "_wants_empty_final", "_rows")

    def __init__(
        self,
        model_name: str = "",
        *,
        id: str = "",  # noqa: A002 - the protobuf field's name
        wants_empty_final: bool = False,
        rows: int = 1,
        request: service_pb2.ModelInferRequest | None = None,
    ) -> None:
        self.model_name = model_name
        self._request = request
        self._id: str | None = id if request is None else None
        self._wants_empty_final: bool | None = wants_empty_final if request is None else None
        self._rows: int | None = rows if request is None else None

    def fields(self) -> tuple[str, str, bool, int]:
        """(model_name, id, wants_empty_final, rows), each read."""
        return self.model_name, self.id, self.wants_empty_final, self.rows

    def __eq__(self, other: object) -> bool:
        return isinstance(other, InferRequestHead) and self.fields() == other.fields()

    __hash__ = None  # type: ignore[assignment]  # equal by its fields, which may be read late

    def __repr__(self) -> str:
        return "InferRequestHead(model_name={!r}, id={!r}, wants_empty_final={!r}, rows={!r})".format(*self.fields())

    @property
    def id(self) -> str:
        if self._id is None:
            assert self._request is not None
            self._id = self._request.id
        return self._id

    @property
    def wants_empty_final(self) -> bool:
        """The caller asked for an empty final response (`triton_enable_empty_final_response`)."""
        if self._wants_empty_final is None:
            assert self._request is not None
            self._wants_empty_final = False
            parameters = self._request.parameters
            if parameters and EMPTY_FINAL_PARAM in parameters:
                param = parameters[EMPTY_FINAL_PARAM]
                self._wants_empty_final = param.WhichOneof("parameter_choice") == "bool_param" and param.bool_param
        return self._wants_empty_final

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
    """Read model_name, id, the empty-final-response opt-in and the batch rows, and check
    the whole request as Triton's parser would (WireError where it would refuse it); tensor
    bytes are skipped.

    Every field is visited (a later model_name would win at Triton, so none may be
    missed), at most `max_fields` of them, nested ones included: a message made of more
    raises TooManyFields after that many steps, whatever its size.

    A message of at most 2 x `max_fields` bytes cannot hold more (each field takes a tag
    byte and at least one value byte, a nested one inside its parent's payload): the
    protobuf runtime (upb, in C) reads it, about 25x faster than the walk here and by
    definition as strictly as Triton's parser. Larger ones are walked under the budget.
    """
    if len(buf) <= 2 * max_fields:
        try:
            request = service_pb2.ModelInferRequest.FromString(buf)
        except DecodeError as e:
            raise WireError(str(e)) from None
        return InferRequestHead(request.model_name, request=request)
    budget = _FieldBudget(max_fields)
    model_name = request_id = ""
    wants_empty_final = False
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
        elif number == _PARAMETERS:
            entry = buf[start:end]
            if _map_entry_key(entry, budget) == EMPTY_FINAL_PARAM:
                wants_empty_final = bool(_map_entry_bool(entry, budget))
    return InferRequestHead(model_name, id=request_id, wants_empty_final=wants_empty_final, rows=rows)


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


@dataclass(slots=True)
class StreamResponseHead:
    """The routing fields of a ModelStreamInferResponse."""

    id: str = ""
    is_error: bool = False
    is_final: bool = False
    has_outputs: bool = False


# A stream response up to this size is read by the protobuf runtime (upb, in C), about
# 4x faster than the walk below for a typical one; a larger one is walked, so that its
# tensor bytes are not copied.
_SMALL_STREAM_RESPONSE = 4096


def peek_stream_response(buf: bytes) -> StreamResponseHead:
    """Which request a stream response belongs to and whether it is that request's last.

    Triton marks every stream response with `triton_final_response`; an error response
    (error_message set) is always the last one of its request.
    """
    if len(buf) <= _SMALL_STREAM_RESPONSE:
        try:
            response = service_pb2.ModelStreamInferResponse.FromString(buf)
        except DecodeError:
            pass  # e.g. a string that is not UTF-8: the walk reads it leniently
        else:
            inner = response.infer_response
            parameters = inner.parameters
            is_error = bool(response.error_message)
            is_final = is_error or (
                FINAL_RESPONSE_PARAM in parameters and parameters[FINAL_RESPONSE_PARAM].bool_param
            )
            return StreamResponseHead(inner.id, is_error, is_final, bool(inner.outputs))
    head = StreamResponseHead()
    for number, wire_type, start, end in _fields(buf):
        if wire_type != _LEN:
            continue
        if number == _STREAM_ERROR and end > start:
            head.is_error = True
        elif number == _STREAM_INFER_RESPONSE:
            inner = buf[start:end]
            for inumber, itype, istart, iend in _fields(inner):
                if itype != _LEN:
                    continue
                if inumber == _ID:
                    head.id = inner[istart:iend].decode("utf-8", "replace")
                elif inumber == _RESPONSE_OUTPUTS:
                    head.has_outputs = True
                elif inumber == _PARAMETERS:
                    entry = inner[istart:iend]
                    if _map_entry_key(entry) == FINAL_RESPONSE_PARAM:
                        head.is_final = bool(_map_entry_bool(entry))
    if head.is_error:
        head.is_final = True
    return head


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
_PRIORITY_FRAGMENTS = {level: _parameter("priority", _UINT64_PARAM, level) for level in range(16)}
_EMPTY_FINAL_FRAGMENT = len_field(
    _PARAMETERS,
    len_field(_KEY, EMPTY_FINAL_PARAM.encode()) + len_field(_VALUE, varint_field(_BOOL_PARAM, 1)),
)


def priority_fragment(level: int) -> bytes:
    """Sets Triton's request `priority` (uint64; 1 is the highest level, 0 the model default)."""
    fragment = _PRIORITY_FRAGMENTS.get(level)
    return fragment if fragment is not None else _parameter("priority", _UINT64_PARAM, level)


def timeout_fragment(timeout_us: int) -> bytes:
    """Sets Triton's request `timeout` (int64 microseconds; Triton's queue policy applies it)."""
    return _parameter("timeout", _INT64_PARAM, max(1, timeout_us))


def empty_final_fragment() -> bytes:
    """Asks Triton for an empty last response when a decoupled model ends without one."""
    return _EMPTY_FINAL_FRAGMENT


def id_fragment(request_id: str) -> bytes:
    """Replaces a ModelInferRequest's id (top-level field 3)."""
    return len_field(_ID, request_id.encode())


_INFER_RESPONSE_TAG = bytes(((_STREAM_INFER_RESPONSE << 3) | _LEN,))


def with_stream_response_id(buf: bytes, request_id: str) -> bytes:
    """A ModelStreamInferResponse with its infer_response's id set to `request_id`.

    The id is appended inside infer_response's own bytes (a later scalar wins), and the
    message is written again around it. Appending a second infer_response instead would
    rely on embedded messages being merged, which protobuf.js (under Node's grpc-js) does
    not do: it keeps the last occurrence only, and its caller would get the id alone."""
    id_field = len_field(_ID, request_id.encode())
    if buf[:1] == _INFER_RESPONSE_TAG:
        length, start = _read_varint(buf, 1)
        if start + length == len(buf):  # the usual response: its infer_response alone
            return b"".join((_INFER_RESPONSE_TAG, _varint(length + len(id_field)), memoryview(buf)[start:], id_field))
    fields = list(_fields(buf))
    last = None
    for index, (number, wire_type, _start, _end) in enumerate(fields):
        if number == _STREAM_INFER_RESPONSE and wire_type == _LEN:
            last = index
    out = bytearray()
    for index, (number, wire_type, start, end) in enumerate(fields):
        if wire_type == _LEN:
            out += len_field(number, buf[start:end] + id_field if index == last else buf[start:end])
        else:
            out += _varint((number << 3) | wire_type) + buf[start:end]
    if last is None:
        out += len_field(_STREAM_INFER_RESPONSE, id_field)
    return bytes(out)
