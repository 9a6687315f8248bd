"""gRPC statuses on the wire: a domain error's status by the one error table, and the
trailer fields that carry a status.

A refusal's status travels as `grpc-status`, `grpc-message` (percent-encoded, cut to 1
KiB) and `grpc-status-details-bin`: a `google.rpc.Status` whose details carry
`google.rpc.RetryInfo` when the domain knows when to retry, and `google.rpc.QuotaFailure`
for a quota (grpcio-status decodes them: `rpc_status.from_call`). The same cause gives the
same status on every RPC, whichever front end answers it.
"""

from __future__ import annotations

import binascii
import functools
import math
import re
import urllib.parse
from collections.abc import Sequence
from dataclasses import dataclass

from google.protobuf import any_pb2
from google.rpc import code_pb2, error_details_pb2, status_pb2

from qosgate import error_table, errors
from qosgate.kserve.wire import len_field, varint_field

Header = tuple[bytes, bytes]

# gRPC status codes the gateway itself produces.
OK = 0
CANCELLED = 1
UNKNOWN = 2
INVALID_ARGUMENT = 3
DEADLINE_EXCEEDED = 4
NOT_FOUND = 5
RESOURCE_EXHAUSTED = 8
UNIMPLEMENTED = 12
INTERNAL = 13
UNAVAILABLE = 14
# gRPC status codes by name (the error table's rows name them) and back (the `code`
# metric label; an out-of-range code is UNKNOWN).
_CODES = dict(code_pb2.Code.items())
_CODE_NAMES = {value: name for name, value in _CODES.items()}


@dataclass(slots=True, init=False)
class Refuse:
    """A gRPC status to end a call with (the relay answers a refused call with it, a
    message stream ends with it)."""

    status: int
    message: str
    details: bytes  # a serialized google.rpc.Status, sent as grpc-status-details-bin
    extra: Sequence[Header]

    def __init__(self, status: int, message: str = "", details: bytes = b"", extra: Sequence[Header] = ()) -> None:
        self.status = status
        self.message = message
        self.details = details
        self.extra = extra


# A call whose stream ended inside a message.
CUT_SHORT = Refuse(INVALID_ARGUMENT, "stream ended inside a gRPC message")


def code_name(code: int) -> str:
    """A gRPC status code's name (the `code` metric label); out of range, UNKNOWN."""
    return _CODE_NAMES.get(code, "UNKNOWN")


# A gRPC client refuses response metadata over 8 KiB (its default limit), and Triton quotes
# request values in its error messages, so a grpc-message is cut to this many bytes.
MAX_MESSAGE_BYTES = 1024
# A byte that grpc-message carries as %XX: outside printable ASCII, or '%' itself.
_NEEDS_ESCAPE = re.compile(rb"[^\x20-\x24\x26-\x7e]")


def status_headers(refusal: Refuse) -> list[Header]:
    """The trailer fields that carry a status, encoded as gRPC requires."""
    fields = list(_status_fields(refusal.status, refusal.message))
    if refusal.details:
        fields.append((b"grpc-status-details-bin", binascii.b2a_base64(refusal.details, newline=False).rstrip(b"=")))
    fields.extend(refusal.extra)
    return fields


@functools.lru_cache(maxsize=256)
def _status_fields(status: int, message: str) -> tuple[Header, ...]:
    """grpc-status and grpc-message, encoded once per pair: a caller retrying a refused
    call gets the same pair again."""
    code = (b"grpc-status", str(status).encode())
    return (code, (b"grpc-message", cut_message(percent_encode(message)))) if message else (code,)


def percent_encode(message: str) -> bytes:
    """grpc-message's encoding: printable ASCII except '%' as is, every other byte %XX."""
    raw = message.encode("utf-8")
    if _NEEDS_ESCAPE.search(raw) is None:  # the usual message: nothing to escape
        return raw
    out = bytearray()
    for byte in raw:
        if 0x20 <= byte <= 0x7E and byte != 0x25:
            out.append(byte)
        else:
            out += b"%%%02X" % byte
    return bytes(out)


def decode_message(encoded: bytes) -> str:
    """A grpc-message's text (percent-decoded; bytes that are no UTF-8 replaced)."""
    if b"%" not in encoded:
        return encoded.decode("utf-8", "replace")
    return urllib.parse.unquote_to_bytes(encoded).decode("utf-8", "replace")


def cut_message(encoded: bytes) -> bytes:
    """A percent-encoded grpc-message cut to MAX_MESSAGE_BYTES, never inside an escape."""
    if len(encoded) <= MAX_MESSAGE_BYTES:
        return encoded
    cut = encoded[: MAX_MESSAGE_BYTES - 3]
    escape = cut.rfind(b"%", len(cut) - 2)
    return (cut if escape == -1 else cut[:escape]) + b"..."


def bounded_messages(headers: Sequence[Header]) -> list[Header]:
    """An upstream's headers or trailers as they came, with a long grpc-message cut."""
    return [(name, cut_message(value) if name == b"grpc-message" else value) for name, value in headers]


# google.rpc.Status.details, Any's fields, RetryInfo.retry_delay, Duration's fields.
_DETAILS = 3
_TYPE_URL, _VALUE = 1, 2
_RETRY_DELAY = 1
_SECONDS, _NANOS = 1, 2
_RETRY_INFO_TYPE_URL = len_field(_TYPE_URL, b"type.googleapis.com/" + error_details_pb2.RetryInfo.DESCRIPTOR.full_name.encode())


def _retry_info_head(size: int) -> bytes:
    """What precedes a Duration of `size` bytes in a RetryInfo details entry (it depends
    on the size alone)."""
    entry = len_field(_DETAILS, _RETRY_INFO_TYPE_URL + len_field(_VALUE, len_field(_RETRY_DELAY, bytes(size))))
    return entry[: len(entry) - size]


# google.protobuf.Duration's largest value (10,000 years): a longer wait is sent as it.
_MAX_DURATION_S = 315_576_000_000
_MAX_DURATION_BYTES = len(varint_field(_SECONDS, _MAX_DURATION_S - 1) + varint_field(_NANOS, 999_999_999))
_RETRY_INFO_HEADS = [_retry_info_head(size) for size in range(_MAX_DURATION_BYTES + 1)]


def _retry_info_detail(seconds: float) -> bytes:
    """A Status's details entry: Any(RetryInfo(retry_delay=`seconds`)), encoded directly
    (it differs in every refusal; the protobuf runtime would build three messages for it)."""
    # Round up: retrying a little late succeeds, retrying early is refused again.
    whole, micros = divmod(max(0, math.ceil(seconds * 1_000_000)), 1_000_000)
    if whole >= _MAX_DURATION_S:
        whole, micros = _MAX_DURATION_S, 0
    delay = (varint_field(_SECONDS, whole) if whole else b"") + (varint_field(_NANOS, micros * 1000) if micros else b"")
    return _RETRY_INFO_HEADS[len(delay)] + delay


@functools.lru_cache(maxsize=1024)
def _fixed_parts(code: int, message: str, violations: tuple[errors.QuotaViolation, ...] | None) -> tuple[bytes, bytes]:
    """The serialized Status fields that repeat from one refusal to the next: code and
    message (fields 1, 2), and the QuotaFailure details entry (empty without violations)."""
    head = status_pb2.Status(code=code, message=message).SerializeToString()
    if violations is None:
        return head, b""
    failure = error_details_pb2.QuotaFailure(
        violations=[error_details_pb2.QuotaFailure.Violation(subject=v.subject, description=v.description) for v in violations]
    )
    detail = any_pb2.Any()
    detail.Pack(failure)
    return head, status_pb2.Status(details=[detail]).SerializeToString()


def status_of(error: BaseException) -> tuple[int, str, bytes]:
    """`error`'s code, public message, and google.rpc.Status serialized (details: RetryInfo
    when it says when to retry, then QuotaFailure for a quota). Fields are written in number
    order, so the bytes are the protobuf runtime's own; the parts that repeat are cached, so a
    tenant retrying a refused call in a loop costs little to answer."""
    row = error_table.row_of(error)
    code = _CODES[row.code]
    message = error_table.public_message(error, row)
    violations = error.violations if isinstance(error, errors.QuotaExceeded) else None
    # An INTERNAL message names its incident: it never repeats, so it is not cached.
    fixed = _fixed_parts.__wrapped__ if row is error_table.INTERNAL else _fixed_parts
    head, quota = fixed(code, message, violations)
    retry_after = getattr(error, "retry_after_s", None)
    retry = b"" if retry_after is None else _retry_info_detail(retry_after)
    return code, message, head + retry + quota


def refusal(error: BaseException) -> Refuse:
    """The status a call refused with `error` ends with: the error table's, details included."""
    code, message, details = status_of(error)
    return Refuse(code, message, details=details)
