"""The one module that touches `ngh2` (libnghttp2, sans-I/O): a young dependency, pinned.

Everything the relay needs from an HTTP/2 stack goes through here, so an upgrade or a
replacement (another binding, `h2`) changes this file alone. What we rely on, and what the
relay's tests check through real peers:

- `auto_window_update=False`: the relay acknowledges a stream's received DATA only once it
  has handed those bytes on (`acknowledge`), which is what makes flow control end to end.
- `send_data` beyond the peer's window queues inside the session; `queued(stream)` reports
  what is still waiting, so the relay knows how much it may acknowledge upstream.
- A stream that closes with unacknowledged DATA keeps that amount charged against the
  CONNECTION window until it is acknowledged: `acknowledge` on the closed stream's id
  still works and returns it (checked against ngh2 0.3.0), so closing calls release it.
- `queued_body_size` of a closed stream is 0 and `reset_stream` of one is a no-op, but
  `send_response` raises StreamUnavailableError and `send_data`/`end_stream`/`send_trailers`
  StreamProtocolError ("stream has no open body") once the peer reset it. The session knows
  that as soon as it reads the RST_STREAM, the relay only when it handles the event, which
  may wait for a later pass (a burst of new calls is started a few per pass): so sending
  on a stream the peer closed sends nothing here, and the events that follow end its call.
- A server connection whose peer resets streams faster than `stream_reset_rate_limit`
  gets GOAWAY from nghttp2 itself, not an error here (see RESET_BURST).
- The connection window is a separate setting (`set_local_window_size`, stream 0) from
  SETTINGS_INITIAL_WINDOW_SIZE, which only covers streams.
- A header value with leading or trailing whitespace is taken, not answered with a stream
  reset as RFC 9113 has libnghttp2 do by default: gRPC servers trim such a value, and
  clients send them (`authorization: Bearer ` with an empty key). ngh2 exposes that option
  only in the build `scripts/build_ngh2.py` makes (`make venv` installs it; with PyPI's
  build such a value still resets the stream, see TRIMS_PADDED_VALUES); `trimmed` trims
  the values of a caller's request.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable, Sequence

import ngh2
from ngh2 import (
    ConnectionClosed,
    DataReceived,
    ErrorCode,
    Event,
    GoAwayReceived,
    RequestReceived,
    ResponseReceived,
    StreamClosed,
    StreamReset,
    TrailersReceived,
    WindowUpdated,
)

__all__ = [
    "ConnectionClosed",
    "DataReceived",
    "ErrorCode",
    "Event",
    "GoAwayReceived",
    "Header",
    "Http2Connection",
    "ProtocolError",
    "RequestReceived",
    "ResponseReceived",
    "StreamClosed",
    "StreamReset",
    "TrailersReceived",
    "WindowUpdated",
    "header",
    "last_header",
    "trimmed",
]

Header = tuple[bytes, bytes]
ProtocolError = ngh2.NGH2Error
# What a send raises on a stream the session has closed (StreamUnavailableError is one).
StreamProtocolError = ngh2.StreamProtocolError

# Per-stream receive window: the most the relay holds for one stream in one direction
# before the sender must wait for it to be passed on.
STREAM_WINDOW = 1 << 20
# Connection receive window: how much many streams together may have in flight.
CONNECTION_WINDOW = 64 << 20
MAX_FRAME_SIZE = 1 << 16
# nghttp2 sends GOAWAY (INTERNAL_ERROR) to a caller that resets streams faster than a
# token bucket allows, a guard against HTTP/2 "rapid reset"; its default (1,000 at once,
# then 33/s) cut off callers doing nothing wrong: cancelling is ordinary gRPC (a deadline,
# a caller done with a stream), and one under load resets as many streams as it opens.
# A reset here costs no more than the call it ends (the upstream stream is reset at once,
# the policy's slot freed), so the bucket only stops resets beyond the calls one relay
# could serve in a second.
RESET_BURST = 10_000
RESET_RATE = 10_000
# Header fields a caller's request may carry, in bytes (nghttp2's default); Triton's
# answers may carry more: its error messages quote the request (a 70 KB version string
# comes back in grpc-message), and the relay cuts them before passing them on. Over the
# bound nghttp2 ends the whole connection, every call on it with it.
MAX_HEADER_LIST = 64 << 10
MAX_UPSTREAM_HEADER_LIST = 4 << 20
_WHITESPACE = b" \t"
# Whether this ngh2 is the build that takes a value with whitespace around it (see the top):
# PyPI's ngh2 0.3.0 is not, and with it such a value resets the caller's stream (INTERNAL to
# a gRPC caller) instead of being trimmed; the gateway serves and warns at its start.
TRIMS_PADDED_VALUES = "leading_and_trailing_ws_validation" in ngh2.Configuration.__dataclass_fields__


def trimmed(headers: Sequence[Header]) -> Sequence[Header]:
    """`headers` with the spaces and tabs around each value removed, as gRPC servers read
    them; `headers` itself when no value has any (the usual case: no copy)."""
    for _, value in headers:
        if value.strip(_WHITESPACE) is not value:  # bytes.strip returns itself unchanged
            return [(name, value.strip(_WHITESPACE)) for name, value in headers]
    return headers


def last_header(headers: Iterable[Header], name: bytes) -> bytes | None:
    """The last value of the field `name` (lower-case) in `headers`, as gRPC metadata
    merges a repeated key, or None."""
    found = None
    for key, value in headers:
        if key == name:
            found = value
    return found


def header(headers: Iterable[Header], name: bytes) -> bytes | None:
    """The first value of the field `name` (lower-case) in `headers`, or None."""
    for key, value in headers:
        if key == name:
            return value
    return None


class Http2Connection:
    """One HTTP/2 connection's protocol state (either role), with manual flow control."""

    __slots__ = ("_conn",)

    def __init__(self, *, server: bool, max_concurrent_streams: int) -> None:
        role = ngh2.Role.SERVER if server else ngh2.Role.CLIENT
        config = ngh2.Configuration(
            auto_window_update=False,
            stream_reset_rate_limit=(RESET_BURST, RESET_RATE),
            max_inbound_header_list_size=MAX_HEADER_LIST if server else MAX_UPSTREAM_HEADER_LIST,
        )
        if TRIMS_PADDED_VALUES:
            config = dataclasses.replace(config, leading_and_trailing_ws_validation=False)
        self._conn = ngh2.Connection(role, config)
        self._conn.initiate_connection(
            {
                ngh2.Setting.INITIAL_WINDOW_SIZE: STREAM_WINDOW,
                ngh2.Setting.MAX_FRAME_SIZE: MAX_FRAME_SIZE,
                ngh2.Setting.MAX_CONCURRENT_STREAMS: max_concurrent_streams,
                ngh2.Setting.ENABLE_PUSH: 0,
            }
        )
        self._conn.set_local_window_size(CONNECTION_WINDOW)

    def feed(self, data: bytes) -> list[Event]:
        """Bytes from the peer in, protocol events out (raises ProtocolError on garbage)."""
        self._conn.receive_data(data)
        return self._conn.events()

    def pending_events(self) -> list[Event]:
        return self._conn.events()

    def outgoing(self) -> bytes:
        return self._conn.data_to_send()

    def send_request(self, headers: Iterable[Header], *, end_stream: bool = False) -> int:
        return self._conn.send_request(headers, end_stream=end_stream)

    # The sends below do nothing on a stream the peer has closed (see the module docstring).

    def send_response(self, stream_id: int, headers: Iterable[Header], *, end_stream: bool = False) -> None:
        try:
            self._conn.send_response(stream_id, headers, end_stream=end_stream)
        except StreamProtocolError:
            pass

    def send_trailers(self, stream_id: int, headers: Iterable[Header]) -> None:
        try:
            self._conn.send_trailers(stream_id, headers)
        except StreamProtocolError:
            pass

    def send_data(self, stream_id: int, data: bytes | memoryview, *, end_stream: bool = False) -> None:
        try:
            self._conn.send_data(stream_id, data, end_stream=end_stream)
        except StreamProtocolError:
            pass

    def end_stream(self, stream_id: int) -> None:
        try:
            self._conn.end_stream(stream_id)
        except StreamProtocolError:
            pass

    def reset(self, stream_id: int, error_code: int) -> None:
        """RST_STREAM; a no-op for a stream that is already closed."""
        self._conn.reset_stream(stream_id, error_code)

    def queued(self, stream_id: int) -> int:
        """DATA bytes of the stream still waiting for the peer's window or the socket."""
        return self._conn.queued_body_size(stream_id)

    def acknowledge(self, stream_id: int, amount: int) -> None:
        """Open the peer's windows by `amount` bytes of this stream that were passed on."""
        self._conn.acknowledge_received_data(amount, stream_id)

    @property
    def send_window(self) -> int:
        """DATA bytes the peer's connection window takes now, over all streams."""
        return self._conn.remote_window_size

    @property
    def wants_write(self) -> bool:
        return self._conn.want_write

    @property
    def wants_read(self) -> bool:
        return self._conn.want_read
