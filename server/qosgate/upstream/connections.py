"""A few persistent HTTP/2 connections per upstream gRPC server, carrying many calls each.

Triton (or the gateway's own grpcio server on a unix socket) is reached over long-lived
connections opened at start and reopened when lost (at once, then with backoff); a call
takes a stream on the least busy one. Events of a stream go to the call that opened it
(`StreamListener`): a call the relay forwards as bytes, or a `ClientStream`, a call the
gateway makes message by message. The gateway's own calls (health checks) are
`ConnectionPool.unary`, and `ConnectionPool.watch` tells when a connection opens or is lost.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import ssl
from collections import deque
from collections.abc import Callable, Sequence
from typing import Protocol

from qosgate.transport import framing, http2
from qosgate.transport.messages import Inbox
from qosgate.transport.peer import Flusher, Peer
from qosgate.transport.status import (
    CANCELLED,
    DEADLINE_EXCEEDED,
    INTERNAL,
    UNAVAILABLE,
    UNKNOWN,
    Refuse,
    bounded_messages,
    status_headers,
)

log = logging.getLogger(__name__)

# Streams the relay asks the upstream to allow it to open on one connection.
_MAX_STREAMS_ADVERTISED = 1000
# A lost connection is retried at once, then at most half a second apart: an attempt that
# often to a down upstream costs nothing, and the health checks wait on it to take the
# upstream back.
_RECONNECT_DELAYS_S = (0.05, 0.2, 0.5)
# The largest response the gateway's own calls (`ConnectionPool.unary`) take.
_MAX_OWN_RESPONSE = 64 << 20
_CANCEL = int(http2.ErrorCode.CANCEL)
_REFUSED_STREAM = int(http2.ErrorCode.REFUSED_STREAM)
_GRPC_REQUEST = ((b"content-type", b"application/grpc"), (b"te", b"trailers"))


class StreamListener(Protocol):
    """What a call does with the events of its upstream stream."""

    def upstream_headers(self, headers: Sequence[http2.Header], end_stream: bool) -> None: ...
    def upstream_data(self, data: bytes, end_stream: bool) -> None: ...
    def upstream_trailers(self, headers: Sequence[http2.Header]) -> None: ...
    def upstream_reset(self, error_code: int) -> None: ...
    def upstream_closed(self) -> None: ...
    def upstream_lost(self) -> None: ...


class UpstreamConnection(Peer):
    """One client-role HTTP/2 connection to an upstream server."""

    def __init__(self, flusher: Flusher, name: str, on_lost: Callable[[], None] | None = None) -> None:
        super().__init__(flusher, server=False, max_concurrent_streams=_MAX_STREAMS_ADVERTISED)
        self.name = name
        self.streams: dict[int, StreamListener] = {}
        self.ready: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        self._on_lost = on_lost

    def open_stream(
        self, headers: Sequence[http2.Header], listener: StreamListener, *, end_stream: bool
    ) -> int:
        stream_id = self.h2.send_request(headers, end_stream=end_stream)
        self.streams[stream_id] = listener
        self.touch()
        return stream_id

    def abandon(self, stream_id: int) -> None:
        """Give up a call's stream here (it goes to another upstream): cancelled, and its
        later events are not the call's."""
        self.streams.pop(stream_id, None)
        self.h2.reset(stream_id, _CANCEL)
        self.touch()

    @property
    def usable(self) -> bool:
        # After the server's GOAWAY, no new streams here.
        return self.transport is not None and not self.closed and not self.went_away

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        super().connection_made(transport)
        if not self.ready.done():
            self.ready.set_result(None)

    def handle(self, events: list[http2.Event]) -> None:
        # Most frequent first (see DownstreamConnection.handle).
        streams = self.streams
        for event in events:
            if isinstance(event, http2.WindowUpdated):
                continue
            if isinstance(event, http2.DataReceived):
                listener = streams.get(event.stream_id)
                if listener is not None:
                    listener.upstream_data(event.data, event.end_stream)
                else:  # a stream we already gave up on: just keep the window open
                    self.h2.acknowledge(event.stream_id, len(event.data))
            elif isinstance(event, http2.ResponseReceived):
                listener = streams.get(event.stream_id)
                if listener is not None:
                    listener.upstream_headers(event.headers, event.end_stream)
            elif isinstance(event, http2.TrailersReceived):
                listener = streams.get(event.stream_id)
                if listener is not None:
                    listener.upstream_trailers(event.headers)
            elif isinstance(event, http2.StreamClosed):
                listener = streams.pop(event.stream_id, None)
                if listener is not None:
                    listener.upstream_closed()
            elif isinstance(event, http2.StreamReset):
                listener = streams.get(event.stream_id)
                if listener is not None:
                    listener.upstream_reset(event.error_code)
            elif isinstance(event, (http2.GoAwayReceived, http2.ConnectionClosed)):
                self.went_away = True

    def lost(self) -> None:
        if not self.ready.done():
            self.ready.set_exception(ConnectionError(f"upstream {self.name} closed"))
        streams, self.streams = self.streams, {}
        for listener in streams.values():
            listener.upstream_lost()
        if self._on_lost is not None:
            self._on_lost()


class ClientSink(Protocol):
    """Where a ClientStream's responses go, as they come."""

    def response(self, message: bytes) -> None:
        """One whole response message (decompressed)."""

    def ended(self, status: int, trailers: Sequence[http2.Header]) -> None:
        """The call ended (once, after its last response): its grpc-status, and the
        fields to pass on to a caller (a lost connection or a reset reads as UNAVAILABLE /
        CANCELLED / INTERNAL, as a gRPC client reports them)."""


# Where a ClientStream goes once more, when its upstream failed it before the first
# response: another upstream's connections, or None to pass the failure on.
Failover = Callable[[], "ConnectionPool | None"]


class ClientStream:
    """A call the gateway makes on an upstream's connections, one message at a time: the
    request (whole, then half-closed) goes out at once, each response message goes to
    `sink` as it comes, and the end once.

    The one retry of every message-level call to Triton: when the upstream fails the call
    before its first response (an UNAVAILABLE status, a refused stream, a lost or missing
    connection) and `failover` names another upstream, the request (kept until then) is
    sent there instead, once; after a response nothing is sent again. A sink that cannot
    take more calls `pause` (the responses' bytes then stay unacknowledged, so Triton
    stops at one stream window) and `resume`."""

    __slots__ = (
        "_pool", "_path", "_extra", "_deadline", "_request", "_sink", "_limit", "_failover",
        "_conn", "stream_id", "_inbox", "_responded", "ended", "_paused", "_end",
    )  # fmt: skip

    def __init__(
        self,
        pool: ConnectionPool,
        path: bytes,
        request: tuple[bytes | memoryview, ...],
        sink: ClientSink,
        *,
        limit: int,
        extra: Sequence[http2.Header] = (),
        timeout_s: float | None = None,
        failover: Failover | None = None,
    ) -> None:
        """`request`: the request message's parts (unframed, joined as they are framed);
        `extra`: headers beside the call's
        own; `timeout_s`: the call's deadline (grpc-timeout, and what is left of it on a
        second attempt); `limit`: the largest response message taken."""
        self._pool = pool
        self._path = path
        self._extra = extra
        self._deadline = None if timeout_s is None else pool.loop.time() + timeout_s
        self._request = framing.frame(*request)
        self._sink: ClientSink | None = sink
        self._limit = limit
        self._failover = failover
        self._conn: UpstreamConnection | None = None
        self.stream_id = 0
        self._inbox: Inbox | None = None
        self._responded = False
        self.ended = False
        self._paused = False
        self._end: tuple[int, Sequence[http2.Header]] | None = None  # held while paused
        self._open()

    def _open(self) -> None:
        conn = self._pool.pick()
        if conn is None:  # the upstream's connections are down (its health check may not know yet)
            self._fail(Refuse(UNAVAILABLE, "no upstream connection"))
            return
        headers = self._pool.call_headers(self._path, self._extra)
        if self._deadline is not None:
            headers.append((b"grpc-timeout", framing.format_timeout(self._deadline - self._pool.loop.time())))
        self._conn = conn
        self.stream_id = conn.open_stream(headers, self, end_stream=False)
        self._inbox = Inbox(conn, self.stream_id, self._limit, b"identity")
        conn.h2.send_data(self.stream_id, self._request, end_stream=True)

    def _fail(self, refusal: Refuse) -> None:
        """The attempt failed before any response: go to the failover's upstream, or end."""
        if not self._responded and self._fail_over():
            return
        self._ended_with(refusal.status, status_headers(refusal))

    def _fail_over(self) -> bool:
        failover, self._failover = self._failover, None  # once
        pool = failover() if failover is not None else None
        if pool is None:
            return False
        if self._conn is not None:
            self._conn.abandon(self.stream_id)
        self._pool, self._conn, self._inbox = pool, None, None
        self._open()
        return True

    def pause(self) -> None:
        """Take no more responses until `resume`."""
        self._paused = True

    def resume(self) -> None:
        self._paused = False
        self._deliver()

    def cancel(self) -> None:
        """Cancel the call upstream (RST_STREAM), unless it has ended; the sink hears no more."""
        if self.ended:
            return
        self.ended = True
        self._sink = None
        conn = self._conn
        if conn is not None:
            conn.h2.reset(self.stream_id, _CANCEL)
            conn.touch()
        if self._inbox is not None:
            self._inbox.close()
        self._request = b""

    def _deliver(self) -> None:
        inbox, sink = self._inbox, self._sink
        if sink is None:  # cancelled
            return
        if inbox is not None:
            while not self._paused and not self.ended:
                message = inbox.take()
                if message is None:
                    break
                if not self._responded:
                    self._responded = True
                    self._request = b""  # never sent again
                sink.response(message)
            error = inbox.error
            if error is not None and not self.ended and self._end is None:
                # Bytes that are no valid message stream (a response over the size limit).
                if self._conn is not None:
                    self._conn.h2.reset(self.stream_id, _CANCEL)
                    self._conn.touch()
                self._end = (error.status, status_headers(error))
        if self._end is not None and not self._paused and not self.ended:  # every response taken
            status, trailers = self._end
            self.ended = True
            self._request = b""
            self._sink = None  # the sink may refer to this stream: no cycle is left behind
            sink.ended(status, trailers)

    def _ended_with(self, status: int, trailers: Sequence[http2.Header]) -> None:
        if self.ended or self._end is not None:
            return
        self._end = (status, trailers)
        if self._inbox is not None:
            self._inbox.end()
        self._deliver()

    # -- StreamListener -------------------------------------------------------------------

    def upstream_headers(self, headers: Sequence[http2.Header], end_stream: bool) -> None:
        if end_stream:  # trailers-only: the status is in these headers
            self.upstream_trailers(headers)
            return
        inbox = self._inbox
        if inbox is not None:
            for name, value in headers:
                if name == b"grpc-encoding":
                    inbox.encoding = value

    def upstream_data(self, data: bytes, end_stream: bool) -> None:
        inbox = self._inbox
        if inbox is None:
            return
        inbox.feed(data, end_stream)
        self._deliver()
        if end_stream:  # DATA with END_STREAM and no trailers
            self._ended_with(UNKNOWN, status_headers(Refuse(UNKNOWN, "upstream ended the call without a status")))

    def upstream_trailers(self, headers: Sequence[http2.Header]) -> None:
        value = http2.header(headers, b"grpc-status")
        status = int(value) if value is not None and value.isdigit() else UNKNOWN
        if status == UNAVAILABLE and not self._responded and self._fail_over():
            return
        trailers = [
            (name, value) for name, value in bounded_messages(headers) if not name.startswith(b":") and name != b"content-type"
        ]
        self._ended_with(status, trailers)

    def upstream_reset(self, error_code: int) -> None:
        if error_code == _REFUSED_STREAM:
            self._fail(Refuse(UNAVAILABLE, "upstream refused the call"))
        elif error_code == _CANCEL:
            self._ended_with(CANCELLED, status_headers(Refuse(CANCELLED, "upstream cancelled the call")))
        else:
            refusal = Refuse(INTERNAL, f"upstream reset the call (HTTP/2 error {error_code})")
            self._ended_with(refusal.status, status_headers(refusal))

    def upstream_closed(self) -> None:
        refusal = Refuse(UNKNOWN, "upstream closed the call without a status")
        self._ended_with(refusal.status, status_headers(refusal))

    def upstream_lost(self) -> None:
        self._fail(Refuse(UNAVAILABLE, "upstream connection lost"))


class ClientReader:
    """A ClientStream's sink for a coroutine: `await next()` gives the responses, then None
    at the end, when `status` and `trailers` are set. Holds at most `buffer` bytes of
    responses before it pauses the stream."""

    __slots__ = ("stream", "_messages", "_held", "_buffer", "_waiter", "status", "trailers")

    def __init__(self, buffer: int = 1 << 20) -> None:
        self.stream: ClientStream | None = None
        self._messages: deque[bytes] = deque()
        self._held = 0
        self._buffer = buffer
        self._waiter: asyncio.Future[None] | None = None
        self.status: int | None = None
        self.trailers: Sequence[http2.Header] = ()

    def response(self, message: bytes) -> None:
        self._messages.append(message)
        self._held += len(message)
        if self._held > self._buffer and self.stream is not None:
            self.stream.pause()
        self._wake()

    def ended(self, status: int, trailers: Sequence[http2.Header]) -> None:
        self.status, self.trailers = status, trailers
        self._wake()

    async def next(self) -> bytes | None:
        while not self._messages:
            if self.status is not None:
                return None
            self._waiter = asyncio.get_running_loop().create_future()
            try:
                await self._waiter
            finally:
                self._waiter = None
        message = self._messages.popleft()
        self._held -= len(message)
        stream = self.stream
        if stream is not None and stream._paused and self._held <= self._buffer // 2:
            stream.resume()
        return message

    def cancel(self) -> None:
        """The reader leaves early: the call is cancelled upstream."""
        if self.stream is not None:
            self.stream.cancel()

    def _wake(self) -> None:
        if self._waiter is not None and not self._waiter.done():
            self._waiter.set_result(None)


# Calls fill one connection before the next takes any: calls that leave together share
# its reads and writes (one syscall, one pass of the session for all of them), where
# spreading them evenly halves every batch. The next connection takes calls once the one
# before holds SPILL_STREAMS streams or its peer's connection window is down to
# SPILL_WINDOW bytes (large tensors in flight: Triton opens 4 MiB per connection); the
# connections stand by, open, for such loads and for one that is lost or told to go away.
SPILL_STREAMS = 64
SPILL_WINDOW = 1 << 20


def has_room(streams: int, send_window: int) -> bool:
    """Whether a connection with `streams` open streams and `send_window` bytes of its
    peer's connection window takes the next call before the connections after it."""
    return streams < SPILL_STREAMS and send_window > SPILL_WINDOW


class ConnectionPool:
    """`size` connections to one address (`host:port` or `unix:/path`), kept open; over
    TLS when given a `tls` context (its ALPN must offer h2)."""

    def __init__(self, flusher: Flusher, address: str, *, size: int = 2, tls: ssl.SSLContext | None = None) -> None:
        self.address = address
        self._tls = tls
        self._flusher = flusher
        self._size = size
        self._connections: list[UpstreamConnection] = []
        self._keeper: asyncio.Task[None] | None = None
        self._wake = asyncio.Event()
        self._stopping = False
        self._watchers: list[Callable[[], None]] = []
        self._failures = 0  # connection attempts in a row that failed
        self.loop = asyncio.get_running_loop()
        scheme = b"http" if tls is None else b"https"
        authority = b"localhost" if address.startswith("unix:") else address.encode()
        self._call_headers = ((b":method", b"POST"), (b":scheme", scheme), (b":authority", authority))

    def watch(self, callback: Callable[[], None]) -> None:
        """Call `callback()` whenever a connection of the pool opens or is lost."""
        self._watchers.append(callback)

    async def start(self) -> None:
        """Open the connections, then keep them open; an upstream not there yet is retried
        in the background (calls meanwhile are UNAVAILABLE)."""
        for _ in range(self._size):
            try:
                self._connections.append(await self._connect())
            except OSError as e:  # ssl.SSLError included
                log.warning("upstream %s: not reachable yet (%s); retrying in the background", self.address, e)
                self._failures = 1
                self._wake.set()
                break
        self._keeper = asyncio.create_task(self._keep_open(), name=f"relay-upstream {self.address}")

    async def stop(self) -> None:
        self._stopping = True
        if self._keeper is not None:
            self._keeper.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._keeper
        for conn in self._connections:
            if conn.transport is not None:
                conn.transport.close()

    def pick(self) -> UpstreamConnection | None:
        """The first usable connection with room (see SPILL_STREAMS), else the usable one
        with the fewest open streams, or None (upstream down)."""
        best: UpstreamConnection | None = None
        room = False
        for conn in self._connections:
            if not conn.usable:
                self._wake.set()  # reopen it
            elif not room:
                streams = len(conn.streams)
                room = has_room(streams, conn.h2.send_window)
                if room or best is None or streams < len(best.streams):
                    best = conn
        if best is None:
            self._wake.set()
        return best

    def call_headers(self, path: bytes, extra: Sequence[http2.Header] = ()) -> list[http2.Header]:
        """The request headers of a gRPC call of `path` on this pool's connections."""
        return [*self._call_headers, (b":path", path), *_GRPC_REQUEST, *extra]

    async def unary(self, path: bytes, message: bytes, timeout_s: float) -> tuple[int, bytes | None]:
        """One unary gRPC call of the gateway's own (a health check): (its grpc-status, the
        response message, None without one). UNAVAILABLE when no connection is open;
        DEADLINE_EXCEEDED when no answer came within `timeout_s` (the call is cancelled)."""
        reader = ClientReader()
        reader.stream = ClientStream(self, path, (message,), reader, limit=_MAX_OWN_RESPONSE, timeout_s=timeout_s)
        response = None
        try:
            async with asyncio.timeout(timeout_s):
                response = await reader.next()
                while await reader.next() is not None:  # a unary call answers one message
                    pass
        except TimeoutError:
            reader.cancel()
            return DEADLINE_EXCEEDED, None
        status = reader.status if reader.status is not None else UNAVAILABLE
        return status, (response if status == 0 else None)

    def _lost(self) -> None:
        """A connection closed: reopen it now (not at the next call), and say so."""
        if not self._stopping:
            self._wake.set()
            self._changed()

    def _changed(self) -> None:
        for callback in self._watchers:
            callback()

    async def _connect(self) -> UpstreamConnection:
        loop = asyncio.get_running_loop()
        conn = UpstreamConnection(self._flusher, self.address, self._lost)
        if self.address.startswith("unix:"):
            await loop.create_unix_connection(lambda: conn, self.address[len("unix:") :])
        else:
            host, _, port = self.address.rpartition(":")
            host = host.strip("[]")
            if self._tls is None:
                await loop.create_connection(lambda: conn, host, int(port))
            else:
                await loop.create_connection(lambda: conn, host, int(port), ssl=self._tls, server_hostname=host)
        await conn.ready
        return conn

    async def _keep_open(self) -> None:
        """Replace connections that closed or were told to go away, with backoff. A
        failed attempt is logged once per outage (an upstream down for an hour is one
        warning, not one every few seconds)."""
        while not self._stopping:
            await self._wake.wait()
            self._wake.clear()
            while len(self._connections) < self._size:
                self._connections.append(UpstreamConnection(self._flusher, self.address))  # closed
            for index, conn in enumerate(self._connections):
                if conn.usable:
                    continue
                if conn.transport is not None and not conn.streams:
                    conn.transport.close()  # drained after GOAWAY
                try:
                    self._connections[index] = await self._connect()
                except OSError as e:  # ssl.SSLError included
                    failures = self._failures
                    if failures == 0:
                        log.warning(
                            "upstream %s: cannot connect (%s); retrying every %g s or less",
                            self.address, e, _RECONNECT_DELAYS_S[-1],
                        )
                    self._failures += 1
                    await asyncio.sleep(_RECONNECT_DELAYS_S[min(failures, len(_RECONNECT_DELAYS_S) - 1)])
                    self._wake.set()
                    break
                if self._failures:
                    log.info("upstream %s: connected after %d failed attempts", self.address, self._failures)
                    self._failures = 0
                self._changed()
