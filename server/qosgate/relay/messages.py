"""Message-level gRPC calls on the relay's connections, for a call the gateway serves one
message at a time (ModelStreamInfer, stream_infer.py) rather than relaying its bytes.

`ServerStream` is a caller's call handed to a handler coroutine (`Relay.serve`);
`ClientStream` is a call the handler makes on an upstream connection. Both read whole
messages (`Inbox`) and write whole messages under the same end-to-end flow control as
relayed calls: received bytes are acknowledged only once the reader has taken the messages
they carried, and a write waits while more than `WRITE_BUFFER` bytes of the stream are
still queued (its peer is not reading).
"""

from __future__ import annotations

import asyncio
import logging
from collections import deque
from collections.abc import Awaitable, Callable, Sequence
from typing import TYPE_CHECKING

from qosgate.auth import ClientCertificate
from qosgate.relay import framing, http2
from qosgate.relay.peer import Peer
from qosgate.relay.policy import (
    CANCELLED,
    CONNECTION_FULL,
    CUT_SHORT,
    DEADLINE_EXCEEDED,
    INTERNAL,
    UNAVAILABLE,
    UNKNOWN,
    Refuse,
    bounded_messages,
    status_headers,
)

if TYPE_CHECKING:
    from qosgate.relay.server import DownstreamConnection
    from qosgate.relay.upstream import UpstreamConnection

log = logging.getLogger(__name__)

# A write returns once at most this many bytes of its stream wait to go out.
WRITE_BUFFER = 256 << 10
# The status fields a handler returns for a call that succeeded.
OK_STATUS: Sequence[http2.Header] = ((b"grpc-status", b"0"),)
_RESPONSE = [(b":status", b"200"), (b"content-type", b"application/grpc")]
_CANCEL = int(http2.ErrorCode.CANCEL)
_REFUSED_STREAM = int(http2.ErrorCode.REFUSED_STREAM)

Handler = Callable[["ServerStream"], Awaitable[Sequence[http2.Header]]]


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


class _Writer:
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


class ServerStream:
    """A caller's call served by a handler one message at a time (see the module).

    The handler returns the status fields to end with (`OK_STATUS`, `status_headers(...)`
    of a refusal, or an upstream's `trailers`); if it raises, the caller gets INTERNAL. The
    caller's reset, its connection's loss and the deadline from `grpc-timeout` cancel it."""

    __slots__ = (
        "_down", "stream_id", "headers", "_inbox", "_writer", "_responded", "finished",
        "_deadline", "_timer", "_task", "_charged",
    )  # fmt: skip

    def __init__(
        self, down: DownstreamConnection, stream_id: int, headers: Sequence[http2.Header], handler: Handler
    ) -> None:
        relay = down.relay
        self._down = down
        self.stream_id = stream_id
        self.headers = headers
        encoding = http2.header(headers, b"grpc-encoding") or b"identity"
        self._inbox = Inbox(down, stream_id, relay.max_message_size, encoding)
        self._writer = _Writer(down, stream_id)
        self._responded = False
        self.finished = False
        self._charged = 0  # bytes of an incomplete message counted against the connection's bound
        self._deadline: float | None = None
        self._timer: asyncio.TimerHandle | None = None
        timeout = http2.header(headers, b"grpc-timeout")
        if timeout is not None:
            seconds = framing.parse_timeout(timeout)
            if seconds is not None:
                self._deadline = relay.loop.time() + seconds
                self._timer = relay.loop.call_at(self._deadline, self._deadline_passed)
        task = relay.loop.create_task(self._run(handler))
        relay.serving.add(task)
        task.add_done_callback(self._handled)
        self._task: asyncio.Task[None] | None = task

    @property
    def certificate(self) -> ClientCertificate | None:
        """The caller's verified TLS client certificate, if any."""
        return self._down.caller.certificate

    def time_remaining(self) -> float | None:
        """Seconds left before the caller's deadline; None without one."""
        return None if self._deadline is None else max(0.0, self._deadline - self._down.relay.loop.time())

    async def read(self) -> bytes | None:
        """The caller's next message (decompressed); None once it half-closed; StreamError
        when its bytes are not a valid message stream."""
        return await self._inbox.read()

    async def write(self, message: bytes) -> None:
        """Send a message to the caller, waiting while too much is queued for it."""
        if self.finished:
            raise StreamError(Refuse(CANCELLED, "the call has ended"))
        self._respond()
        await self._writer.write(message)

    def write_now(self, message: bytes) -> bool:
        """Send a message to the caller if it has room (True), without waiting; False when
        it has too much queued already (then `write` it). A call that has ended takes
        nothing more (True)."""
        if self.finished:
            return True
        if self._down.h2.queued(self.stream_id) > WRITE_BUFFER:
            return False
        self._respond()
        self._writer.send(message)
        return True

    def _respond(self) -> None:
        if not self._responded:
            self._responded = True
            self._down.h2.send_response(self.stream_id, _RESPONSE)

    # -- the relay's events ---------------------------------------------------------------

    def client_data(self, data: bytes, end_stream: bool) -> None:
        inbox = self._inbox
        inbox.feed(data, end_stream)
        held = inbox.held
        down = self._down
        down.pending_bytes += held - self._charged
        self._charged = held
        if held and down.pending_bytes > down.relay.max_connection_pending:
            inbox.fail(CONNECTION_FULL)
            self._uncharge()

    def client_reset(self, error_code: int) -> None:
        self._end()

    def client_closed(self) -> None:
        self._end()

    # -- ends -------------------------------------------------------------------------------

    async def _run(self, handler: Handler) -> None:
        try:
            trailers = await handler(self)
        except asyncio.CancelledError:
            return  # the call ended first (reset, lost, deadline): nothing more to say
        except Exception:
            log.exception("relay stream handler failed")
            trailers = status_headers(Refuse(INTERNAL, "internal error"))
        self._finish(trailers)

    def _finish(self, trailers: Sequence[http2.Header]) -> None:
        """Answer the call with `trailers` (a status), unless it is over already."""
        if self.finished:
            return
        down = self._down
        if self._responded:
            down.h2.send_trailers(self.stream_id, trailers)
        else:
            down.h2.send_response(self.stream_id, [*_RESPONSE, *trailers], end_stream=True)
        down.touch()
        self._end()

    def _handled(self, task: asyncio.Task[None]) -> None:
        # The stream lets go of its finished task (whose frames refer to the stream).
        self._down.relay.serving.discard(task)
        self._task = None

    def _deadline_passed(self) -> None:
        self._timer = None
        self._finish(status_headers(Refuse(DEADLINE_EXCEEDED, "Deadline Exceeded")))

    def _end(self) -> None:
        if self.finished:
            return
        self.finished = True
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None
        self._inbox.close()
        self._uncharge()
        self._writer.release()
        task = self._task
        if task is not None and task is not asyncio.current_task():  # not the handler's own answer
            task.cancel()

    def _uncharge(self) -> None:
        self._down.pending_bytes -= self._charged
        self._charged = 0



class ClientStream:
    """A call the gateway makes on an upstream connection, one message at a time.

    `read` gives the upstream's messages, then None when the call has ended: `status` is
    its grpc-status and `trailers` the fields to pass on to a caller (a lost connection or
    a reset reads as UNAVAILABLE / CANCELLED / INTERNAL, as a gRPC client reports them)."""

    __slots__ = ("_conn", "stream_id", "_inbox", "_writer", "status", "trailers", "ended")

    def __init__(self, conn: UpstreamConnection, headers: Sequence[http2.Header], max_response_size: int) -> None:
        self._conn = conn
        self.status: int | None = None
        self.trailers: Sequence[http2.Header] = ()
        self.ended = False
        self.stream_id = conn.open_stream(headers, self, end_stream=False)
        self._inbox = Inbox(conn, self.stream_id, max_response_size, b"identity")
        self._writer = _Writer(conn, self.stream_id)

    async def read(self) -> bytes | None:
        try:
            return await self._inbox.read()
        except StreamError as e:  # a response over the size limit
            if not self.ended:
                self._conn.h2.reset(self.stream_id, _CANCEL)
                self._conn.touch()
                self._ended_with(e.refusal)
            return None

    async def write(self, *parts: bytes) -> None:
        """Send a message (`parts` joined, so a large one is copied once) upstream;
        StreamError once the call has ended."""
        if self.ended:
            raise StreamError(Refuse(self.status if self.status is not None else CANCELLED, "upstream call ended"))
        await self._writer.write(*parts)

    def done_writing(self) -> None:
        if not self.ended:
            self._conn.h2.end_stream(self.stream_id)
            self._conn.touch()

    def cancel(self) -> None:
        """Cancel the call upstream (RST_STREAM), unless it has ended."""
        if not self.ended:
            self._conn.h2.reset(self.stream_id, _CANCEL)
            self._conn.touch()
            self._ended_with(Refuse(CANCELLED, "cancelled"))
            self._inbox.close()

    # -- StreamListener ---------------------------------------------------------------------

    def upstream_headers(self, headers: Sequence[http2.Header], end_stream: bool) -> None:
        if end_stream:  # trailers-only: the status is in these headers
            self.upstream_trailers(headers)
            return
        for name, value in headers:
            if name == b"grpc-encoding":
                self._inbox.encoding = value

    def upstream_data(self, data: bytes, end_stream: bool) -> None:
        self._inbox.feed(data, end_stream)
        if end_stream and not self.ended:  # DATA with END_STREAM and no trailers
            self._ended_with(Refuse(UNKNOWN, "upstream ended the call without a status"))

    def upstream_trailers(self, headers: Sequence[http2.Header]) -> None:
        if self.ended:
            return
        self.ended = True
        status = http2.header(headers, b"grpc-status")
        self.status = int(status) if status is not None and status.isdigit() else UNKNOWN
        self.trailers = [
            (name, value)
            for name, value in bounded_messages(headers)
            if not name.startswith(b":") and name != b"content-type"
        ]
        self._inbox.end()

    def upstream_reset(self, error_code: int) -> None:
        if error_code == _CANCEL:
            self._ended_with(Refuse(CANCELLED, "upstream cancelled the call"))
        elif error_code == _REFUSED_STREAM:
            self._ended_with(Refuse(UNAVAILABLE, "upstream refused the call"))
        else:
            self._ended_with(Refuse(INTERNAL, f"upstream reset the call (HTTP/2 error {error_code})"))
        self._inbox.close()

    def upstream_closed(self) -> None:
        self._ended_with(Refuse(UNKNOWN, "upstream closed the call without a status"))
        self._inbox.close()
        self._writer.release()

    def upstream_lost(self) -> None:
        self._ended_with(Refuse(UNAVAILABLE, "upstream connection lost"))
        self._inbox.close()
        self._writer.release()

    def _ended_with(self, refusal: Refuse) -> None:
        if self.ended:
            return
        self.ended = True
        self.status = refusal.status
        self.trailers = status_headers(refusal)
        self._inbox.end()

