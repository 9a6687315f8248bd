"""The gateway's ModelStreamInfer on the relay, the KServe streaming data path: each request
of a stream scheduled on its own through the data plane (dataplane/plane.py).

A stream is served message by message (messages.ServerStream) and goes to one Triton on one
upstream stream (messages.ClientStream), over the relay's persistent HTTP/2 connections:

identify (key headers, or the TLS client certificate) → the tenant's stream limit → pick
the upstream → per request: read the model from its bytes → the data plane's path
(authorize, admit, dispatch slot, deadline) → append Triton's priority and timeout, a
gateway id and a request for an empty final response → send it up the stream.

Requests get a gateway id on their way up (appended; the caller's id comes back appended
to each response), so responses of interleaved requests can be matched to the request
holding the dispatch slot. Triton is asked for an empty final response so that a decoupled
model's end is always seen; callers that did not ask for it do not get it. A refusal of one
request is reported in the stream, as Triton reports a failed request, and the stream goes
on (under `triton_grpc_error: true` it ends the stream with the refusal's status, as Triton
does). A failure of the upstream call ends the stream with Triton's own status fields.

Everything a stream holds is bounded (`limits`): responses waiting for the caller
(`stream_buffer_bytes`) and requests read and not finished (`stream_max_pending`). While
the caller does not read, the session stops reading Triton's responses and the caller's
requests, and its requests at Triton give their dispatch slots back (`CallScope.free_slot`).
"""

from __future__ import annotations

import asyncio
import collections
import itertools
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

from tritonclient.grpc import service_pb2

from qosgate import errors
from qosgate.auth import Tenant
from qosgate.config import GatewayConfig
from qosgate.dataplane.plane import CallCost, CallScope, DataPlane
from qosgate.memory import HeapTrimmer
from qosgate.quota import Refused, StreamLimiter
from qosgate.error_table import row_of
from qosgate.kserve import wire
from qosgate.kserve.names import GRPC_ERROR_HEADER, PRIORITY_HEADER, STREAM_INFER, path
from qosgate.relay.infer_policy import ModelFacts, peek_infer_request, request_cost
from qosgate.relay.messages import OK_STATUS, ServerStream
from qosgate.transport import framing, http2
from qosgate.transport.messages import StreamError
from qosgate.transport.status import UNAVAILABLE, Refuse, code_name, refusal, status_headers, status_of
from qosgate.upstream import Upstream, UpstreamPool
from qosgate.upstream.connections import ClientStream, ConnectionPool

STREAM_RPC = STREAM_INFER
PATH = path(STREAM_INFER)
_GRPC_ERROR = GRPC_ERROR_HEADER.encode()


class StreamInferHandler:
    """Serves ModelStreamInfer calls (a messages.Handler); `connections` maps each
    upstream's name to the relay's pool of HTTP/2 connections to it."""

    def __init__(
        self,
        *,
        config: GatewayConfig,
        plane: DataPlane,
        pool: UpstreamPool,
        connections: Mapping[str, ConnectionPool],
        streams: StreamLimiter,
        heap: HeapTrimmer,
    ) -> None:
        self.config = config
        self.models = ModelFacts(config)
        self.plane = plane
        self.pool = pool
        self.connections = connections
        self.streams = streams
        self.heap = heap
        self.stream_ids = itertools.count(1)

    async def __call__(self, stream: ServerStream) -> Sequence[http2.Header]:
        metadata = [
            (key.decode("latin-1"), value.decode("latin-1"))
            for key, value in stream.headers
            if not key.startswith(b":")
        ]
        try:
            tenant = self.plane.directory.identify(metadata, stream.certificate)
        except errors.GatewayError as e:
            self.plane.metrics.rejected(row_of(e).reason, "", "")
            return status_headers(refusal(e))
        # Text headers by key, a repeated key keeping its last value; none read is binary.
        headers = {key: value for key, value in metadata if not key.endswith("-bin")}
        return await _Session(self, tenant, stream, headers).run()


@dataclass(slots=True, eq=False)
class _InFlight:
    """A request of a stream that Triton has not finished yet."""

    client_id: str
    wants_empty_final: bool
    scope: CallScope
    done: asyncio.Event = field(default_factory=asyncio.Event)
    failed: bool = False  # Triton answered with an error_message

    def end(self, failed: bool = False) -> None:
        self.failed = failed
        self.done.set()
        self.scope.free_slot()


class _Outbox:
    """The responses of one stream waiting for its caller to read them, bounded in bytes.

    `put` waits while the buffer holds `max_bytes` or more (a message larger than the
    bound still passes once the buffer is below it), so the stream's producers stop when
    its caller stops reading. `flowing` is set while there is room.
    """

    def __init__(self, max_bytes: int) -> None:
        self._items: collections.deque[bytes] = collections.deque()
        self._bytes = 0
        self._max_bytes = max_bytes
        self._readable = asyncio.Event()
        self._closed = False
        self.flowing = asyncio.Event()
        self.flowing.set()

    def full(self) -> bool:
        return self._bytes >= self._max_bytes

    def idle(self) -> bool:
        """Nothing queued and still open: a response may go out past the queue."""
        return not self._items and not self._closed

    async def put(self, item: bytes) -> None:
        """Queue `item` once there is room; after `close` it is dropped (the stream ended)."""
        while self.full() and not self._closed:
            await self.flowing.wait()
        if self._closed:
            return
        self._items.append(item)
        self._bytes += len(item)
        if self.full():
            self.flowing.clear()
        self._readable.set()

    def close(self) -> None:
        """Nothing more is queued: `get` returns what is already there, then None."""
        self._closed = True
        self._readable.set()
        self.flowing.set()

    async def get(self) -> bytes | None:
        while not self._items:
            if self._closed:
                return None
            self._readable.clear()
            await self._readable.wait()
        item = self._items.popleft()
        self._bytes -= len(item)
        if not self.full():
            self.flowing.set()
        return item


def _in_band_message(error: BaseException) -> str:
    """The `error_message` of an in-band ModelStreamInferResponse: KServe streams report a
    failed request inside the stream and keep it open, so the code cannot travel as a
    status: it leads the text instead ("RESOURCE_EXHAUSTED: ...")."""
    code, message, _ = status_of(error)
    return f"{code_name(code)}: {message}"


def _stream_error(request_id: str, message: str) -> bytes:
    return service_pb2.ModelStreamInferResponse(
        error_message=message, infer_response=service_pb2.ModelInferResponse(id=request_id)
    ).SerializeToString()


class _Session:
    """One ModelStreamInfer call (see the module): one upstream stream, each request a
    call of the data plane (`CallScope`), closed when its final response arrives."""

    def __init__(
        self, handler: StreamInferHandler, tenant: Tenant, stream: ServerStream, headers: dict[str, str]
    ) -> None:
        self._h = handler
        self._tenant = tenant
        self._stream = stream
        self._headers = headers
        self._limits = handler.config.limits
        self._outbox = _Outbox(self._limits.stream_buffer_bytes)
        self._in_flight: dict[str, _InFlight] = {}
        self._tasks: set[asyncio.Task[None]] = set()
        self._write_lock = asyncio.Lock()  # one request's bytes at a time up the stream
        self._fatal: Sequence[http2.Header] | None = None  # the status that ends the stream early
        self._close_on_error = headers.get(GRPC_ERROR_HEADER, "").lower() == "true"
        self._prefix = f"qg{next(handler.stream_ids)}-"
        self._upstream_name = ""
        self._ids = itertools.count(1)

    async def run(self) -> Sequence[http2.Header]:
        h = self._h
        try:
            upstream = h.pool.pick()
            opened = h.streams.open(self._tenant)
            if isinstance(opened, Refused):
                raise opened.error()
        except errors.GatewayError as e:  # counted as a refused call of no model
            await h.plane.open(STREAM_RPC, self._tenant, "", self._headers).close(e)
            return status_headers(refusal(e))
        # Compiled by mypyc, so no await in a `finally` (see CallScope.close_with_code).
        failed: BaseException | None = None
        try:
            ended = await self._relay(upstream)
        except BaseException as e:
            failed = e
        await opened.permit.release()
        if failed is not None:
            raise failed
        return ended

    def _upstream_headers(self) -> list[http2.Header]:
        stream = self._stream
        headers = [
            (b":method", b"POST"),
            (b":scheme", http2.header(stream.headers, b":scheme") or b"http"),
            (b":path", PATH),
            (b":authority", http2.header(stream.headers, b":authority") or b"triton"),
            (b"content-type", b"application/grpc"),
            (b"te", b"trailers"),
        ]
        left = stream.time_remaining()
        if left is not None:
            headers.append((b"grpc-timeout", framing.format_timeout(left)))
        if self._close_on_error:
            headers.append((_GRPC_ERROR, self._headers[GRPC_ERROR_HEADER].encode("latin-1")))
        return headers

    async def _relay(self, upstream: Upstream) -> Sequence[http2.Header]:
        h = self._h
        conn = h.connections[upstream.name].pick()
        if conn is None:  # its connections are down (its health check may not know yet)
            h.pool.recheck(upstream)
            return status_headers(Refuse(UNAVAILABLE, "no upstream connection"))
        self._upstream_name = upstream.name
        with upstream.lease():
            call = ClientStream(conn, self._upstream_headers(), self._limits.max_response_bytes)
            pump = asyncio.create_task(self._pump(call))
            reader = asyncio.create_task(self._read(call))
            failed: BaseException | None = None
            try:
                while (item := await self._outbox.get()) is not None:
                    await self._stream.write(item)
                ended = self._ending(call, upstream)
            except BaseException as e:
                failed = e
            # The caller left (or we are done): stop reading it, drop its queued
            # requests, and cancel the upstream stream so Triton stops generating.
            for task in (pump, reader, *self._tasks):
                task.cancel()
            call.cancel()
            await asyncio.gather(pump, reader, *self._tasks, return_exceptions=True)
            if failed is not None:
                raise failed
            return ended

    def _ending(self, call: ClientStream, upstream: Upstream) -> Sequence[http2.Header]:
        """The status the stream ends with, once the caller has its last response."""
        if self._fatal is not None:
            return self._fatal
        if call.ended and call.status != 0:
            if call.status == UNAVAILABLE:
                self._h.pool.recheck(upstream)  # it may have gone away: check it now
            return call.trailers
        return OK_STATUS

    async def _pump(self, call: ClientStream) -> None:
        pending = asyncio.Semaphore(self._limits.stream_max_pending)
        try:
            while True:
                # A caller that does not read its responses gets no more requests read.
                await self._outbox.flowing.wait()
                await pending.acquire()
                raw = await self._stream.read()
                if raw is None:
                    break
                self._h.heap.message(len(raw))
                task = asyncio.create_task(self._serve(call, raw))
                raw = None  # held by the task only, until it is sent upstream
                self._tasks.add(task)
                task.add_done_callback(self._tasks.discard)
                task.add_done_callback(lambda _: pending.release())
        except StreamError as e:  # the caller's bytes are not a valid message stream
            self._fatal = status_headers(e.refusal)
            self._outbox.close()
            return
        # The caller half-closed: once its requests are finished, so do we upstream.
        while self._tasks:
            await asyncio.gather(*self._tasks, return_exceptions=True)
        call.done_writing()

    async def _serve(self, call: ClientStream, raw: bytes) -> None:
        """One request of the stream: a call of the data plane of its own, its refusal
        answered in the stream (or ending it, under `triton_grpc_error`)."""
        h = self._h
        malformed: errors.InvalidArgument | None = None
        try:
            head = peek_infer_request(raw, self._limits.max_request_fields)
        except errors.InvalidArgument as e:  # a call of no model, refused like any other
            head, malformed = wire.InferRequestHead(), e
        try:
            async with h.plane.open(STREAM_RPC, self._tenant, head.model_name, self._headers) as scope:
                if malformed is not None:
                    raise malformed
                # Nothing of a stream whose caller is not reading is admitted.
                await self._outbox.flowing.wait()
                dispatching = self._dispatch(scope, call, head, raw)
                raw = b""  # held by `_dispatch` only, which lets go of it once it is sent
                await dispatching
        except Exception as e:  # refused (the table's code), or a bug (INTERNAL, logged)
            if self._close_on_error:
                self._fatal = status_headers(refusal(e))
                self._outbox.close()
            else:
                await self._outbox.put(_stream_error(head.id, _in_band_message(e)))

    async def _dispatch(
        self, scope: CallScope, call: ClientStream, head: wire.InferRequestHead, raw: bytes
    ) -> None:
        """Admit the request, send it up the stream and wait for its final response; the
        reader (`_read`) reports its responses to the scope."""
        h = self._h
        cost = CallCost(fair_share=request_cost(h.models.cost_unit(head.model_name), head, len(raw)))
        deadline = h.plane.deadline(self._stream.time_remaining())
        dispatch = await scope.admit(cost, priority_class=self._headers.get(PRIORITY_HEADER), deadline=deadline)
        fragment = wire.priority_fragment(dispatch.priority_level)
        if scope.timeout_us is not None:
            fragment += wire.timeout_fragment(scope.timeout_us)
        gateway_id = f"{self._prefix}{next(self._ids)}"
        entry = _InFlight(head.id, head.wants_empty_final, scope)
        self._in_flight[gateway_id] = entry
        if self._outbox.full():
            scope.free_slot()  # see `_deliver`
        try:
            scope.upstream_started(self._upstream_name)
            try:
                async with self._write_lock:
                    await call.write(
                        raw, fragment, wire.id_fragment(gateway_id), wire.empty_final_fragment()
                    )
            except StreamError as e:
                # The upstream stream ended under us: the reader reports it to the caller.
                await scope.close_with_code(code_name(e.refusal.status), e)
                return
            raw = b""  # sent: a request waiting at Triton does not keep its bytes here
            await entry.done.wait()
        finally:
            self._in_flight.pop(gateway_id, None)
        if entry.failed:
            # In-band errors carry no status code; the metric still must not say OK.
            await scope.close_with_code("UPSTREAM_ERROR")

    async def _read(self, call: ClientStream) -> None:
        try:
            while (raw := await call.read()) is not None:
                head = wire.peek_stream_response(raw)
                entry = self._in_flight.get(head.id)
                if entry is None:
                    await self._deliver(raw)
                    continue
                if not head.is_error:
                    entry.scope.responded()  # an error names no model that exists
                if head.is_final:
                    entry.end(failed=head.is_error)
                    if not (head.has_outputs or head.is_error or entry.wants_empty_final):
                        continue  # the empty final response we asked for, not the caller
                await self._deliver(wire.with_stream_response_id(raw, entry.client_id))
        finally:
            # Requests Triton did not finish: failed if the upstream stream did. Any end
            # but OK goes to the caller, CANCELLED included (Triton gave up on the stream):
            # only this session cancels the call itself, and then nobody listens.
            failed = call.ended and call.status != 0
            for entry in self._in_flight.values():
                entry.end(failed=failed)
            self._outbox.close()

    async def _deliver(self, response: bytes) -> None:
        """Queue a response for the caller; while its buffer is full, stop reading Triton."""
        if self._outbox.full():
            # The caller is not reading: its requests at Triton give their slots back
            # rather than hold the model's window while this stream waits.
            for entry in self._in_flight.values():
                entry.scope.free_slot()
        self._h.heap.message(len(response))
        # With nothing queued before it and room at the caller, a response goes out at
        # once, without a turn of the writer (`_relay`).
        if self._outbox.idle() and self._stream.write_now(response):
            return
        await self._outbox.put(response)
