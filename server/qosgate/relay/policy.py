"""What the relay asks before it forwards a call, and what it is told.

Per call the relay hands a `CallHead` (request headers and the first message, already
decompressed) to a `CallPolicy`; the answer is `Forward` (with headers to set and bytes to
append to the first message, and an `on_finish` callback for release and accounting) or
`Refuse` (a gRPC status answered by the relay itself, no upstream call made). The policy
may answer at once or return an awaitable (admission and scheduling wait).
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Protocol

from qosgate.auth import ConnectionCredentials
from qosgate.dataplane.call import Call
from qosgate.kserve.names import PRIORITY_HEADER
from qosgate.transport.status import RESOURCE_EXHAUSTED, Header, Refuse

_PRIORITY = PRIORITY_HEADER.encode()

if TYPE_CHECKING:
    from qosgate.upstream.connections import ConnectionPool

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
    upstream: ConnectionPool | None  # where to; None: the route's pool
    # Asked when the upstream fails the call UNAVAILABLE (or drops it) before any response,
    # while the relay still holds the whole request: another pool to send it to once, or
    # None to pass the failure on.
    failover: Callable[[], ConnectionPool | None] | None

    def __init__(
        self,
        set_headers: Sequence[Header] = (),
        drop_headers: frozenset[bytes] = frozenset(),
        append: bytes = b"",
        on_finish: Callable[[CallEnd], None] | None = None,
        upstream: ConnectionPool | None = None,
        failover: Callable[[], ConnectionPool | None] | None = None,
    ) -> None:
        self.set_headers = set_headers
        self.drop_headers = drop_headers
        self.append = append
        self.on_finish = on_finish
        self.upstream = upstream
        self.failover = failover


Decision = Forward | Refuse

# A call whose request bytes, read before the gateway could decide on them, would take its
# connection over its bound (`Relay.max_connection_pending`).
CONNECTION_FULL = Refuse(
    RESOURCE_EXHAUSTED,
    "too many request bytes waiting on this connection; retry when its other calls have been admitted",
)


class CallPolicy(Protocol):
    """Decides each relayed call from its headers and first message."""

    def __call__(self, head: CallHead) -> Decision | Awaitable[Decision]: ...


def call_of(rpc: str, headers: Sequence[Header], caller: ConnectionCredentials, timeout_s: float | None) -> Call:
    """A call on the relay as the edge takes it (the one decoding of every gRPC call the
    relay decides or serves): its headers as sent, the class asked for in `x-priority`,
    the seconds left of its `grpc-timeout`."""
    priority = None
    for name, value in headers:
        if name == _PRIORITY:
            priority = value  # the last one, as gRPC metadata merges them
    return Call(rpc, headers, caller, priority_class=priority.decode("latin-1") if priority else None, timeout_s=timeout_s)
