"""A few persistent HTTP/2 connections per upstream gRPC server, carrying many calls each.

Triton (or the gateway's own grpcio server on a unix socket) is reached over long-lived
connections opened at start and reopened when lost; a call takes a stream on the least
busy one. Events of a stream go to the call that opened it (`StreamListener`).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import ssl
from collections.abc import Sequence
from typing import Protocol

from qosgate.relay import http2
from qosgate.relay.peer import Flusher, Peer

log = logging.getLogger(__name__)

# Streams the relay asks the upstream to allow it to open on one connection.
_MAX_STREAMS_ADVERTISED = 1000
_RECONNECT_DELAYS_S = (0.05, 0.2, 1.0, 2.0)


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

    def __init__(self, flusher: Flusher, name: str) -> None:
        super().__init__(flusher, server=False, max_concurrent_streams=_MAX_STREAMS_ADVERTISED)
        self.name = name
        self.streams: dict[int, StreamListener] = {}
        self.ready: asyncio.Future[None] = asyncio.get_running_loop().create_future()

    def open_stream(
        self, headers: Sequence[http2.Header], listener: StreamListener, *, end_stream: bool
    ) -> int:
        stream_id = self.h2.send_request(headers, end_stream=end_stream)
        self.streams[stream_id] = listener
        self.touch()
        return stream_id

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


class UpstreamPool:
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

    async def start(self) -> None:
        """Open the connections, then keep them open; an upstream not there yet is retried
        in the background (calls meanwhile are UNAVAILABLE)."""
        for _ in range(self._size):
            try:
                self._connections.append(await self._connect())
            except OSError as e:  # ssl.SSLError included
                log.warning("upstream %s: not reachable yet (%s)", self.address, e)
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
        """The usable connection with the fewest open streams, or None (upstream down)."""
        best: UpstreamConnection | None = None
        for conn in self._connections:
            if conn.usable and (best is None or len(conn.streams) < len(best.streams)):
                best = conn
        if best is None or any(not c.usable for c in self._connections):
            self._wake.set()
        return best

    async def _connect(self) -> UpstreamConnection:
        loop = asyncio.get_running_loop()
        conn = UpstreamConnection(self._flusher, self.address)
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
        """Replace connections that closed or were told to go away, with backoff."""
        failures = 0
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
                    failures = 0
                except OSError as e:  # ssl.SSLError included
                    delay = _RECONNECT_DELAYS_S[min(failures, len(_RECONNECT_DELAYS_S) - 1)]
                    failures += 1
                    log.warning("upstream %s: reconnect failed (%s); retrying in %.2fs", self.address, e, delay)
                    await asyncio.sleep(delay)
                    self._wake.set()
                    break
