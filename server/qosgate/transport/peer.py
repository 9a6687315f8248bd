"""One HTTP/2 connection on an asyncio transport, and the flow of bytes between two of them.

A relayed call joins a stream of the caller's connection to a stream of an upstream
connection. Each direction is a `Pipe`: bytes received on the source stream are handed to
the sink stream at once, and acknowledged to the source (opening its window) only when the
sink has written them out. So the relay holds at most one stream window per direction of a
call, and a reader that stops reading stops its own upstream stream, nothing else.

Writes are batched: a connection with something to send is marked dirty, and `Flusher`
writes every dirty connection once at the end of the callback that dirtied it.
"""

from __future__ import annotations

import asyncio
import logging
from collections import deque
from collections.abc import Callable
from typing import Any, Protocol, TypeVar, cast

from qosgate.transport import http2

log = logging.getLogger(__name__)
T = TypeVar("T")


class Draining(Protocol):
    """Something waiting for a connection to write out its bytes (`Peer.draining`)."""

    def settle(self) -> bool:
        """Called after each write of the connection; True while still waiting."""
        ...


class Writable(Protocol):
    """What the Flusher uses of a connection (a `Peer`)."""

    dirty: bool  # marked, not yet written in this pass

    def write_out(self) -> None: ...

    def abort(self) -> None: ...


class Pipe:
    """One direction of a call: source stream → sink stream, with unacknowledged bytes."""

    __slots__ = ("source", "source_id", "sink", "sink_id", "unacked", "held", "pushed", "credit")

    def __init__(self, source: Peer, source_id: int) -> None:
        self.source = source
        self.source_id = source_id
        self.sink: Peer | None = None
        self.sink_id = 0
        self.unacked = 0  # received from the source, not yet acknowledged to it
        self.held = 0  # of those, bytes the relay keeps itself until the sink exists
        self.pushed = 0  # bytes handed to the sink stream
        # Bytes handed to the sink first that were acknowledged already (a first message
        # the policy read, as re-sent): they leave the sink's queue before the others.
        self.credit = 0

    def received(self, size: int) -> None:
        self.unacked += size

    def push(self, data: bytes, *, end_stream: bool = False) -> None:
        sink = self.sink
        assert sink is not None
        sink.h2.send_data(self.sink_id, data, end_stream=end_stream)
        self.pushed += len(data)
        sink.draining.add(self)
        sink.touch()

    def release(self, size: int) -> None:
        """Acknowledge bytes the relay consumed itself (a first message it read)."""
        if size > 0:
            self.unacked -= size
            self.source.acknowledge(self.source_id, size)

    def drop(self) -> None:
        """The call is over: nothing will be handed on, give the source its window back."""
        self.held = 0
        self.sink = None
        self.release(self.unacked)

    def settle(self) -> bool:
        """Acknowledge what the sink wrote out; True while bytes are still outstanding."""
        sink = self.sink
        waiting = self.held
        if sink is not None:
            queued = sink.h2.queued(self.sink_id)
            credit_left = max(0, self.credit - (self.pushed - queued))
            waiting += queued - credit_left
        self.release(self.unacked - waiting)
        return self.unacked > 0


class Flusher:
    """Writes every connection marked dirty, once, after the loop's current I/O callbacks,
    then runs the callbacks deferred with `later`.

    The loop runs the callbacks of every socket that became readable, then the ones they
    scheduled: so calls that arrived together on several connections leave in one write
    per connection, not one per event. Work deferred with `later` (a finished call's
    accounting) runs after those writes, off the path of the bytes it follows.
    """

    __slots__ = ("_dirty", "_later", "_scheduled", "_loop")

    def __init__(self) -> None:
        self._dirty: list[Writable] = []
        self._later: deque[tuple[Callable[[Any], None], Any]] = deque()
        self._scheduled = False
        self._loop = asyncio.get_running_loop()

    def mark(self, peer: Writable) -> None:
        self._dirty.append(peer)
        self._schedule()

    def later(self, callback: Callable[[T], None], argument: T) -> None:
        """Run `callback(argument)` in this pass, after the writes (exceptions are logged)."""
        self._later.append((callback, argument))
        self._schedule()

    def _schedule(self) -> None:
        if not self._scheduled:
            self._scheduled = True
            self._loop.call_soon(self.flush)

    def flush(self) -> None:
        # Writing one connection settles pipes and so marks others, and deferred work may
        # too: all of them are written in this same pass, not in another callback.
        dirty, later = self._dirty, self._later
        try:
            while dirty or later:
                while dirty:
                    peer = dirty.pop()
                    peer.dirty = False
                    try:
                        peer.write_out()
                    except Exception:
                        # A bug, not the peer's doing: its calls fail (the connection
                        # closes) rather than wait forever on a connection nobody writes.
                        log.exception("relay: writing to a connection failed; closing it")
                        peer.abort()
                while later and not dirty:
                    callback, argument = later.popleft()
                    try:
                        callback(argument)
                    except Exception:
                        log.exception("relay: a deferred callback failed")
        finally:
            self._scheduled = False
            if dirty or later:  # left by an exception that is not a bug of ours (the loop stops)
                self._schedule()


class Peer(asyncio.Protocol):
    """An HTTP/2 connection (either role) on a transport; subclasses handle its events."""

    def __init__(self, flusher: Flusher, *, server: bool, max_concurrent_streams: int) -> None:
        self.h2 = http2.Http2Connection(server=server, max_concurrent_streams=max_concurrent_streams)
        self.flusher = flusher
        self.transport: asyncio.Transport | None = None
        self.dirty = False
        self.closed = False
        self.went_away = False  # the peer sent GOAWAY (subclasses' handle sets it)
        self._ended = False  # the session is over and the transport closing
        self._paused = False
        # Pipes whose sink is this connection and whose source still waits for acks, and
        # message streams (messages.py) waiting for their queued bytes to go out.
        self.draining: set[Draining] = set()

    # -- asyncio.Protocol ----------------------------------------------------------------

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        # uvloop's transports implement asyncio.Transport without subclassing it.
        self.transport = cast(asyncio.Transport, transport)
        self.touch()

    def data_received(self, data: bytes) -> None:
        try:
            events = self.h2.feed(data)
        except http2.ProtocolError as e:
            log.info("closing an HTTP/2 connection after a protocol error: %s", e)
            self._ended = True
            self.write_out()  # the GOAWAY saying why
            if self.transport is not None:
                self.transport.close()
            return
        self.handle(events)
        h2 = self.h2
        if h2.wants_write or not h2.wants_read:  # its own frames to send (acks), or closing
            self.touch()

    def pause_writing(self) -> None:
        self._paused = True

    def resume_writing(self) -> None:
        self._paused = False
        self.touch()

    def connection_lost(self, exc: Exception | None) -> None:
        self.closed = True
        self.transport = None
        self.lost()

    def acknowledge(self, stream_id: int, size: int) -> None:
        """Open the peer's windows by `size` bytes of the stream that were passed on."""
        if not self.closed:
            self.h2.acknowledge(stream_id, size)
            if self.h2.wants_write:  # a WINDOW_UPDATE is due (past half the window)
                self.touch()

    # -- writing ------------------------------------------------------------------------

    def touch(self) -> None:
        if not self.dirty and not self.closed:
            self.dirty = True
            self.flusher.mark(self)

    def write_out(self) -> None:
        """Send what the session has (unless the socket pushes back), then settle pipes."""
        transport = self.transport
        if transport is None:
            return
        if not self._paused:
            data = self.h2.outgoing()
            if data:
                transport.write(data)
            # Sending closes streams (END_STREAM, RST_STREAM): their events come out here.
            events = self.h2.pending_events()
            if events:
                self.handle(events)
        if self.draining:
            for waiting in list(self.draining):
                if not waiting.settle():
                    self.draining.discard(waiting)
        if not (self.h2.wants_read or self.h2.wants_write):
            if not (self._ended or self.went_away):
                # Neither a protocol error nor the peer's GOAWAY: nghttp2 ended the session
                # itself, which it does (GOAWAY and all) when a guard against abusive peers
                # trips. The peer's calls end with it, so say so.
                log.warning(
                    "relay: nghttp2 ended the HTTP/2 connection with %s: a guard against abusive "
                    "peers tripped (stream resets, protocol glitches or unanswered control frames)",
                    transport.get_extra_info("peername"),
                )
            self._ended = True
            transport.close()

    def abort(self) -> None:
        if self.transport is not None:
            self.transport.abort()

    # -- for subclasses -------------------------------------------------------------------

    def handle(self, events: list[http2.Event]) -> None:
        raise NotImplementedError

    def lost(self) -> None:
        """The transport is gone: every stream on it ends now."""
        raise NotImplementedError
