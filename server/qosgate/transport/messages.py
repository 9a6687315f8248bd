"""Whole gRPC messages on an HTTP/2 stream, for calls the gateway reads and writes message
by message (the relay's served calls, its calls to Triton) rather than relays as bytes.

`Inbox` collects a stream's DATA into whole messages (decompressed) and `Writer` writes
whole messages, under the same end-to-end flow control as relayed calls: received bytes
are acknowledged only once the reader has taken the messages they carried, and a write
waits while more than `WRITE_BUFFER` bytes of the stream are still queued (its peer is not
reading).
"""

from __future__ import annotations

import asyncio
from collections import deque

from qosgate.transport import framing
from qosgate.transport.peer import Peer
from qosgate.transport.status import CUT_SHORT, Refuse

# A write returns once at most this many bytes of its stream wait to go out.
WRITE_BUFFER = 256 << 10


class StreamError(Exception):
    """The call cannot go on; `refusal` is the status it ends with."""

    def __init__(self, refusal: Refuse) -> None:
        super().__init__(refusal.message)
        self.refusal = refusal


class Inbox:
    """Whole messages out of a stream's DATA chunks, decompressed, for one reader.

    The bytes of a message still coming are acknowledged at once (a message may be larger
    than the stream window; the size limit bounds it). Once whole messages wait, further
    bytes stay unacknowledged until the reader has taken them all: a reader that stops
    reading stops its sender at one stream window.
    """

    __slots__ = (
        "_buf", "_ready", "_unacked", "_ended", "_closed", "_error", "_waiter", "_limit",
        "encoding", "_peer", "_stream_id",
    )  # fmt: skip

    def __init__(self, peer: Peer, stream_id: int, limit: int, encoding: bytes) -> None:
        self._buf = bytearray()  # the start of a message still coming
        self._ready: deque[bytes] = deque()
        self._unacked = 0
        self._ended = False  # END_STREAM seen: nothing more comes
        self._closed = False  # the stream is gone: everything is acknowledged as it comes
        self._error: Refuse | None = None
        self._waiter: asyncio.Future[None] | None = None
        self._limit = limit
        self.encoding = encoding
        # The stream's connection, not the stream: an inbox refers to nothing that refers
        # to it, so a finished call is freed at once rather than by the cycle collector.
        self._peer = peer
        self._stream_id = stream_id

    @property
    def held(self) -> int:
        """Bytes of an incomplete message held."""
        return len(self._buf)

    def feed(self, data: bytes, end_stream: bool) -> None:
        if self._closed or self._error is not None or self._ended:
            self._peer.acknowledge(self._stream_id, len(data))
            return
        self._unacked += len(data)
        try:
            self._split(data)
        except framing.FramingError as e:
            self.fail(Refuse(e.status, str(e)))
            return
        if end_stream:
            self.end()
        if not self._ready:
            self._acknowledge()
        self._wake()

    def _split(self, data: bytes) -> None:
        size = len(data)
        if not self._buf and size >= framing.PREFIX and data[0] == 0:
            length = int.from_bytes(data[1 : framing.PREFIX], "big")
            if framing.PREFIX + length == size and length <= self._limit:  # the usual chunk: one message
                self._ready.append(data[framing.PREFIX :])
                return
        buf = self._buf
        buf += data
        pos = 0
        while len(buf) - pos >= framing.PREFIX:
            length = int.from_bytes(buf[pos + 1 : pos + framing.PREFIX], "big")
            if length > self._limit:
                raise framing.MessageTooLarge(length, self._limit)
            end = pos + framing.PREFIX + length
            if len(buf) < end:
                break
            with memoryview(buf) as view:  # one copy (a bytearray's slice would be two)
                payload = bytes(view[pos + framing.PREFIX : end])
            if buf[pos] == 1:
                payload = framing.decompress(self.encoding, payload, self._limit)
            self._ready.append(payload)
            pos = end
        if pos:
            del buf[:pos]

    def end(self) -> None:
        """Nothing more comes; a message cut short fails the call."""
        self._ended = True
        if self._buf:
            self.fail(CUT_SHORT)
        self._wake()

    def fail(self, refusal: Refuse) -> None:
        self._error = refusal
        self._buf = bytearray()
        self._acknowledge()
        self._wake()

    def close(self) -> None:
        """The stream is gone: acknowledge all it sent (its connection's window); messages
        already whole can still be read."""
        self._closed = True
        self._ended = True
        self._buf = bytearray()
        self._acknowledge()
        self._wake()

    @property
    def error(self) -> Refuse | None:
        """Why the stream's bytes are no valid message stream (a message over the size
        limit, a corrupt one, one cut short), once they proved not to be."""
        return self._error

    def take(self) -> bytes | None:
        """The next whole message if one is in (None if not), for a reader that is told
        when bytes arrive rather than waiting for them."""
        if not self._ready:
            return None
        message = self._ready.popleft()
        if not self._ready:
            self._acknowledge()
        return message

    async def read(self) -> bytes | None:
        """The next message; None once the stream has ended; StreamError if it failed."""
        while not self._ready:
            if self._error is not None:
                raise StreamError(self._error)
            if self._ended:
                return None
            self._waiter = asyncio.get_running_loop().create_future()
            try:
                await self._waiter
            finally:
                self._waiter = None
        message = self._ready.popleft()
        if not self._ready:
            self._acknowledge()
        return message

    def _acknowledge(self) -> None:
        if self._unacked:
            unacked, self._unacked = self._unacked, 0
            self._peer.acknowledge(self._stream_id, unacked)

    def _wake(self) -> None:
        if self._waiter is not None and not self._waiter.done():
            self._waiter.set_result(None)


class Writer:
    """Writes messages on one stream of `peer`, waiting while its queue is over WRITE_BUFFER."""

    __slots__ = ("_peer", "_stream_id", "_writable")

    def __init__(self, peer: Peer, stream_id: int) -> None:
        self._peer = peer
        self._stream_id = stream_id
        self._writable: asyncio.Future[None] | None = None

    def send(self, *parts: bytes) -> None:
        """Queue a message (`parts` joined) on the stream, however much is queued already."""
        peer = self._peer
        peer.h2.send_data(self._stream_id, framing.frame(*parts))
        peer.touch()

    async def write(self, *parts: bytes) -> None:
        self.send(*parts)
        peer = self._peer
        if peer.h2.queued(self._stream_id) > WRITE_BUFFER:
            self._writable = asyncio.get_running_loop().create_future()
            peer.draining.add(self)
            try:
                await self._writable
            finally:
                self._writable = None

    def settle(self) -> bool:
        """After a write of the connection: wake a write waiting for room; True while it waits."""
        writable = self._writable
        if writable is None:
            return False
        if self._peer.closed or self._peer.h2.queued(self._stream_id) <= WRITE_BUFFER:
            if not writable.done():
                writable.set_result(None)
            return False
        return True

    def release(self) -> None:
        """The stream ended: a write still waiting returns (its bytes are not going out)."""
        if self._writable is not None and not self._writable.done():
            self._writable.set_result(None)
