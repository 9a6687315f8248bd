"""Calls the relay serves itself, one message at a time (ModelStreamInfer, stream_infer.py),
rather than relaying their bytes.

`ServerStream` is a caller's call handed to a handler coroutine (`Relay.serve`); it reads
and writes whole messages under end-to-end flow control (transport/messages.py).
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable, Sequence
from typing import TYPE_CHECKING

from qosgate.auth import ConnectionCredentials
from qosgate.relay.policy import CONNECTION_FULL
from qosgate.transport import framing, http2
from qosgate.transport.messages import WRITE_BUFFER, Inbox, StreamError, Writer
from qosgate.transport.status import CANCELLED, DEADLINE_EXCEEDED, INTERNAL, Refuse, status_headers

if TYPE_CHECKING:
    from qosgate.relay.server import DownstreamConnection

log = logging.getLogger(__name__)

# A call answered before its caller half-closed waits this long at most for the half-close
# before its answer goes out (see `ServerStream._finish`).
ANSWER_HOLD_S = 0.25

# The status fields a handler returns for a call that succeeded.
OK_STATUS: Sequence[http2.Header] = ((b"grpc-status", b"0"),)
_RESPONSE = [(b":status", b"200"), (b"content-type", b"application/grpc")]

Handler = Callable[["ServerStream"], Awaitable[Sequence[http2.Header]]]


class ServerStream:
    """A caller's call served by a handler one message at a time (see the module).

    The handler returns the status fields to end with (`OK_STATUS`, `status_headers(...)`
    of a refusal, or an upstream's `trailers`); if it raises, the caller gets INTERNAL. The
    caller's reset, its connection's loss and the deadline from `grpc-timeout` cancel it."""

    __slots__ = (
        "_down", "stream_id", "headers", "_inbox", "_writer", "_responded", "finished",
        "_deadline", "_timer", "_task", "_charged", "_client_done", "_held", "_hold",
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
        self._writer = Writer(down, stream_id)
        self._responded = False
        self.finished = False
        self._charged = 0  # bytes of an incomplete message counted against the connection's bound
        self._client_done = False  # the caller half-closed
        # An answer held for the caller's half-close (`_finish`), and its timer.
        self._held: Sequence[http2.Header] | None = None
        self._hold: asyncio.TimerHandle | None = None
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
    def caller(self) -> ConnectionCredentials:
        """The caller's connection: its verified TLS client certificate, if any."""
        return self._down.caller

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
        if end_stream:
            self._client_done = True
            if self._held is not None:
                self._answer_held()
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
        self._drop_held()
        self._end()

    def client_closed(self) -> None:
        self._drop_held()
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
        """Answer the call with `trailers` (a status), unless it is over already.

        A call refused before it responded and before its caller half-closed (as a
        ModelStreamInfer stream opens, say) is over at once, but its answer waits for the
        half-close, ANSWER_HOLD_S at most: the answer ends the stream at both ends (the
        HTTP/2 layer resets the caller's side), and grpcio's asyncio client reports a
        write or half-close that it makes after that as INTERNAL "Internal error from
        Core", in place of the status it was sent (grpc/grpc#36066). A caller refused
        for its quota or its key would read INTERNAL, and not know to wait or to stop."""
        if self.finished:
            return
        if not self._responded and not self._client_done:
            self._held = trailers
            self._hold = self._down.relay.loop.call_later(ANSWER_HOLD_S, self._answer_held)
            self._end()
            return
        self._answer(trailers)
        self._end()

    def _answer(self, trailers: Sequence[http2.Header]) -> None:
        down = self._down
        if self._responded:
            down.h2.send_trailers(self.stream_id, trailers)
        else:
            down.h2.send_response(self.stream_id, [*_RESPONSE, *trailers], end_stream=True)
        down.touch()

    def _answer_held(self) -> None:
        held = self._held
        self._drop_held()
        if held is not None:
            self._answer(held)

    def _drop_held(self) -> None:
        self._held = None
        if self._hold is not None:
            self._hold.cancel()
            self._hold = None

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
