"""What the relay asks before it forwards a call, and what it is told.

Per call the relay hands a `CallHead` (request headers and the first message, already
decompressed) to a `CallPolicy`; the answer is `Forward` (with headers to set and bytes to
append to the first message, and an `on_finish` callback for release and accounting) or
`Refuse` (a gRPC status answered by the relay itself, no upstream call made). The policy
may answer at once or return an awaitable (admission and scheduling wait).
"""

from __future__ import annotations

import binascii
import functools
import re
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Protocol

from qosgate.auth import ConnectionCredentials

if TYPE_CHECKING:
    from qosgate.relay.upstream import UpstreamPool

Header = tuple[bytes, bytes]

# gRPC status codes the relay itself produces.
CANCELLED = 1
UNKNOWN = 2
INVALID_ARGUMENT = 3
DEADLINE_EXCEEDED = 4
RESOURCE_EXHAUSTED = 8
UNIMPLEMENTED = 12
INTERNAL = 13
UNAVAILABLE = 14


@dataclass(slots=True, init=False)
class CallHead:
    """A call as the policy sees it before anything goes upstream."""

    path: bytes
    headers: Sequence[Header]
    first_message: bytes | memoryview  # uncompressed; empty when the caller sent no message
    timeout: float | None  # seconds left from grpc-timeout when asked; None without one
    # The caller's connection: its verified TLS certificate, the tenants its keys identified.
    caller: ConnectionCredentials

    # Written out (init=False) for this class and the others built on every call: the
    # `__init__` that `dataclasses` generates is interpreted even in a compiled module.
    def __init__(
        self,
        path: bytes,
        headers: Sequence[Header],
        first_message: bytes | memoryview,
        timeout: float | None,
        caller: ConnectionCredentials | None = None,
    ) -> None:
        self.path = path
        self.headers = headers
        self.first_message = first_message
        self.timeout = timeout
        self.caller = ConnectionCredentials() if caller is None else caller

    def header(self, name: bytes) -> bytes | None:
        """The last value of a header (lower-case name), as gRPC metadata merges them."""
        found = None
        for key, value in self.headers:
            if key == name:
                found = value
        return found

    @property
    def method(self) -> str:
        """The RPC's method name (`/pkg.Service/Method` → `Method`)."""
        return self.path.rsplit(b"/", 1)[-1].decode("ascii", "replace")


@dataclass(slots=True, init=False)
class CallEnd:
    """How a forwarded call ended, for release and accounting."""

    status: int | None  # grpc-status; None when the stream was reset instead
    reset_code: int | None  # the RST_STREAM code, when reset
    requests: int  # messages the caller sent
    responses: int  # messages the upstream answered

    def __init__(self, status: int | None, reset_code: int | None, requests: int, responses: int) -> None:
        self.status = status
        self.reset_code = reset_code
        self.requests = requests
        self.responses = responses


@dataclass(slots=True, init=False)
class Forward:
    """Send the call upstream, changed as given."""

    set_headers: Sequence[Header]  # replace headers of the same name, or add
    drop_headers: frozenset[bytes]  # names of headers not sent upstream
    append: bytes  # appended to the first message (protobuf merges it)
    # Called once when the call ends, right after the relay has written what ended it.
    on_finish: Callable[[CallEnd], None] | None
    upstream: UpstreamPool | None  # where to; None: the route's pool
    # Asked when the upstream fails the call UNAVAILABLE (or drops it) before any response,
    # while the relay still holds the whole request: another pool to send it to once, or
    # None to pass the failure on.
    failover: Callable[[], UpstreamPool | None] | None

    def __init__(
        self,
        set_headers: Sequence[Header] = (),
        drop_headers: frozenset[bytes] = frozenset(),
        append: bytes = b"",
        on_finish: Callable[[CallEnd], None] | None = None,
        upstream: UpstreamPool | None = None,
        failover: Callable[[], UpstreamPool | None] | None = None,
    ) -> None:
        self.set_headers = set_headers
        self.drop_headers = drop_headers
        self.append = append
        self.on_finish = on_finish
        self.upstream = upstream
        self.failover = failover


@dataclass(slots=True, init=False)
class Refuse:
    """Answer the call with this status, without an upstream call."""

    status: int
    message: str
    details: bytes  # a serialized google.rpc.Status, sent as grpc-status-details-bin
    extra: Sequence[Header]

    def __init__(self, status: int, message: str = "", details: bytes = b"", extra: Sequence[Header] = ()) -> None:
        self.status = status
        self.message = message
        self.details = details
        self.extra = extra


Decision = Forward | Refuse

# A call whose stream ended inside a message.
CUT_SHORT = Refuse(INVALID_ARGUMENT, "stream ended inside a gRPC message")
# A call whose request bytes, read before the gateway could decide on them, would take its
# connection over its bound (`Relay.max_connection_pending`).
CONNECTION_FULL = Refuse(
    RESOURCE_EXHAUSTED,
    "too many request bytes waiting on this connection; retry when its other calls have been admitted",
)


class CallPolicy(Protocol):
    """Decides each relayed call from its headers and first message."""

    def __call__(self, head: CallHead) -> Decision | Awaitable[Decision]: ...


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
