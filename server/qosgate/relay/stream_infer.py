"""The gateway's ModelStreamInfer on the relay, the KServe streaming data path: each request
of a caller's stream is a call of its own through the edge.

A stream is served message by message (messages.ServerStream); its caller is identified
once, and its tenant's open streams are bounded. Each request in it is decoded (its model
and id read from its bytes; for an LLM's request, its prompt and max_tokens, so that it is
charged in tokens: `adapters.asks`; under the model's `kserve_token_counts`, the engine's
own counts are asked for and read from its responses), admitted by the edge
(`qosgate.edge`), routed by its own model's routing policy (prefix affinity on the model's
session header included) and sent to Triton as a ModelStreamInfer of its own,
half-closed, on the upstream's persistent connections (connections.ClientStream), with
Triton's priority and timeout appended. Triton's responses, which carry the request's own
id, go back onto the caller's stream as they come, and that upstream stream's end is the
request's end. So the requests of one stream for different models go where each model's
policy says, and a request whose Triton fails before its first response fails over like
any call (`Route.failover`).

A refusal of one request is reported in the stream, as Triton reports a failed request (a
response with `error_message` = `"<CODE>: <reason>"` and the request's id), and the
stream goes on; so is an upstream failure of one request. Under `triton_grpc_error: true`
(passed on to Triton too) either ends the stream with its status instead, as Triton does.

Everything a stream holds is bounded (`limits`): responses waiting for the caller
(`stream_buffer_bytes`) and requests read and not finished (`stream_max_pending`). While
the caller does not read, the session takes no more of Triton's responses (their bytes
stay unacknowledged, so Triton stops) nor of the caller's requests, and its requests at
Triton give their dispatch slots back (`CallScope.free_slot`).
"""

from __future__ import annotations

import asyncio
from collections import deque
from collections.abc import Awaitable, Sequence
from typing import Any

from tritonclient.grpc import service_pb2

from qosgate import errors
from qosgate.adapters.asks import EngineCounts, GenerationAsk, generation_ask
from qosgate.config import ResourceLimits
from qosgate.dataplane.call import Admitted, Call
from qosgate.dataplane.plane import CallCost, CallScope
from qosgate.edge import Edge
from qosgate.eager import run_eagerly
from qosgate.kserve import wire
from qosgate.kserve.names import GRPC_ERROR_HEADER, STREAM_INFER, path
from qosgate.memory import HeapTrimmer
from qosgate.quota import Refused, StreamLimiter
from qosgate.quota.tokens import estimate_prompt_tokens
from qosgate.relay.infer_policy import peek_infer_request, request_cost
from qosgate.relay.messages import OK_STATUS, ServerStream
from qosgate.relay.policy import call_of
from qosgate.transport import http2
from qosgate.transport.messages import StreamError
from qosgate.transport.status import OK, UNAVAILABLE, code_name, decode_message, refusal, status_headers, status_of
from qosgate.upstream.connections import ClientStream
from qosgate.upstream.pool import Route

PATH = path(STREAM_INFER)
_GRPC_ERROR = GRPC_ERROR_HEADER.encode()


class StreamInferHandler:
    """Serves ModelStreamInfer calls (a messages.Handler)."""

    def __init__(self, *, edge: Edge, streams: StreamLimiter, limits: ResourceLimits, heap: HeapTrimmer) -> None:
        self.edge = edge
        self.streams = streams
        self.limits = limits
        self.heap = heap

    async def __call__(self, stream: ServerStream) -> Sequence[http2.Header]:
        call = call_of(STREAM_INFER, stream.headers, stream.caller, stream.time_remaining())
        try:
            tenant = self.edge.identify(call)
        except errors.GatewayError as e:
            return status_headers(refusal(e))
        opened = self.streams.open(tenant)
        if isinstance(opened, Refused):  # counted as a refused call of no model
            error = opened.error()
            await self.edge.open(call).close(error)
            return status_headers(refusal(error))
        # Compiled by mypyc, so no await in a `finally` (see CallScope.close_with_code).
        failed: BaseException | None = None
        ended: Sequence[http2.Header] = OK_STATUS
        try:
            ended = await _Session(self, call, stream).run()
        except BaseException as e:
            failed = e
        await opened.permit.release()
        if failed is not None:
            try:
                raise failed
            finally:  # interpreted, the frame would hold its own exception: a cycle
                failed = None
        return ended


def _stream_error(request_id: str, error: BaseException) -> bytes:
    """An in-band response reporting a failed request: KServe streams report it inside
    the stream and go on, so the code leads the text ("RESOURCE_EXHAUSTED: ...")."""
    code, message, _ = status_of(error)
    return service_pb2.ModelStreamInferResponse(
        error_message=f"{code_name(code)}: {message}", infer_response=service_pb2.ModelInferResponse(id=request_id)
    ).SerializeToString()


def _upstream_failure(request_id: str, status: int, trailers: Sequence[http2.Header]) -> bytes:
    """An in-band response reporting that Triton (or the way to it) failed a request."""
    message = decode_message(http2.header(trailers, b"grpc-message") or b"")
    return service_pb2.ModelStreamInferResponse(
        error_message=f"{code_name(status)}: {message}", infer_response=service_pb2.ModelInferResponse(id=request_id)
    ).SerializeToString()


class _Session:
    """One ModelStreamInfer call (see the module): its requests in flight, and the
    responses waiting for its caller."""

    def __init__(self, handler: StreamInferHandler, call: Call, stream: ServerStream) -> None:
        self.handler = handler
        self.call = call
        self.stream = stream
        limits = handler.limits
        self.limits = limits
        self.in_flight: set[_Request] = set()
        # Responses waiting for the caller, and their bytes; `flowing` while below the bound.
        self.outbox: deque[bytes] = deque()
        self.queued = 0
        self.flowing = asyncio.Event()
        self.flowing.set()
        self.idle = asyncio.Event()  # no request in flight
        self.idle.set()
        self.room = asyncio.Event()  # fewer than stream_max_pending requests in flight
        self.room.set()
        self.fatal: Sequence[http2.Header] | None = None  # the status that ends the stream early
        self._task: asyncio.Task[Any] | None = None  # the one running `run`
        grpc_error = call.header(_GRPC_ERROR)
        self.close_on_error = grpc_error is not None and grpc_error.lower() == b"true"
        self.extra: tuple[http2.Header, ...] = ((_GRPC_ERROR, grpc_error),) if grpc_error is not None else ()
        self.closing: set[asyncio.Future[Any]] = set()  # scope closes waiting on a shared store
        self._writer: asyncio.Task[None] | None = None

    async def run(self) -> Sequence[http2.Header]:
        self._task = asyncio.current_task()
        failed: BaseException | None = None
        try:
            await self._take_requests()
            # The caller half-closed: once its requests are finished and their responses
            # written, so is the stream.
            while self.in_flight:
                await self.idle.wait()
            writer = self._writer
            if writer is not None:
                await writer
        except asyncio.CancelledError as e:
            if self.fatal is None:  # the caller left (its reset, deadline, connection)
                failed = e
        except BaseException as e:
            failed = e
        # The caller left, the stream ended early, or we are done: nothing of it runs on.
        for request in list(self.in_flight):
            request.cancel()
        if self._writer is not None:
            self._writer.cancel()
            self._writer = None
        self._task = None  # its frames refer to this session
        if failed is not None:
            try:
                raise failed
            finally:  # as in StreamInferHandler.__call__
                failed = None
        return self.fatal if self.fatal is not None else OK_STATUS

    async def _take_requests(self) -> None:
        stream, heap = self.stream, self.handler.heap
        while self.fatal is None:
            # A caller that does not read its responses gets no more requests read.
            if not self.flowing.is_set():
                await self.flowing.wait()
            if not self.room.is_set():
                await self.room.wait()
            try:
                raw = await stream.read()
            except StreamError as e:  # the caller's bytes are not a valid message stream
                self.end(status_headers(e.refusal))
                return
            if raw is None:
                return
            heap.message(len(raw))
            self._start(raw)

    def _start(self, raw: bytes) -> None:
        """One request of the stream: decoded, then admitted as a call of its own."""
        handler, stream, call = self.handler, self.stream, self.call
        try:
            head = peek_infer_request(raw, self.limits.max_request_fields)
        except errors.InvalidArgument as e:  # a call of no model, refused like any other
            self._refused(handler.edge.open(call), "", e)
            return
        request_call = Call(
            STREAM_INFER,
            call.headers,
            call.caller,
            model=head.model_name,
            priority_class=call.priority_class,
            timeout_s=stream.time_remaining(),
            tenant=call.tenant,
        )
        models = handler.edge.models
        # An LLM's request is charged in tokens, as the generation API charges its own.
        ask = generation_ask(raw)
        counts = ask.counts if ask is not None and models.engine_token_counts(head.model_name) else None
        request = _Request(self, handler.edge.open(request_call), head.id, raw, ask, counts)
        self.in_flight.add(request)
        self.idle.clear()
        if len(self.in_flight) >= self.limits.stream_max_pending:
            self.room.clear()
        if ask is None:
            cost = CallCost(fair_share=request_cost(models.cost_unit(head.model_name), head, len(raw)))
        else:
            cost = request.scope.llm_cost(request.prompt_tokens, ask.max_tokens)
        request.admit(request_call, cost)

    def _refused(self, scope: CallScope, request_id: str, error: BaseException) -> None:
        """A request refused before it went upstream: counted, and answered in the stream."""
        self.settle(scope.end(error))
        if self.close_on_error:
            self.end(status_headers(refusal(error)))
        else:
            self.deliver(_stream_error(request_id, error))

    def finished(self, request: _Request) -> None:
        self.in_flight.discard(request)
        if len(self.in_flight) < self.limits.stream_max_pending:
            self.room.set()
        if not self.in_flight:
            self.idle.set()

    def end(self, trailers: Sequence[http2.Header]) -> None:
        """End the stream early with `trailers` (its first such end wins)."""
        if self.fatal is None:
            self.fatal = trailers
            task = self._task
            if task is not None and not task.done():
                task.cancel()  # `run` stops waiting, and returns `trailers`

    def settle(self, pending: Awaitable[None] | None) -> None:
        """Keep a scope's close that waits (a shared quota store) until it is done."""
        if pending is not None:
            closing = asyncio.ensure_future(pending)
            self.closing.add(closing)
            closing.add_done_callback(self.closing.discard)

    # -- responses to the caller ------------------------------------------------------------

    def deliver(self, response: bytes) -> None:
        """Send a response to the caller, or queue it while the caller is behind."""
        self.handler.heap.message(len(response))
        # With nothing queued before it and room at the caller, a response goes out at
        # once, without a turn of the writer.
        if not self.outbox and self.stream.write_now(response):
            return
        self.outbox.append(response)
        self.queued += len(response)
        if self.queued >= self.limits.stream_buffer_bytes and self.flowing.is_set():
            # The caller is not reading: take no more responses from Triton, and let its
            # requests there give their slots back rather than hold the model's window.
            self.flowing.clear()
            for request in tuple(self.in_flight):  # a hold may end a request
                request.hold()
        if self._writer is None:
            self._writer = asyncio.get_running_loop().create_task(self._write())

    async def _write(self) -> None:
        try:
            while self.outbox:
                response = self.outbox[0]
                await self.stream.write(response)
                self.outbox.popleft()
                self.queued -= len(response)
                if not self.flowing.is_set() and self.queued < self.limits.stream_buffer_bytes:
                    self.flowing.set()
                    # A request resumed may deliver what it kept, end, and leave in_flight.
                    for request in tuple(self.in_flight):
                        request.release()
        except StreamError:
            pass  # the caller's stream ended: the session is being torn down
        finally:
            self._writer = None


class _Request:
    """One request of a stream at Triton: its scope, its upstream call (a ClientSink)."""

    __slots__ = (
        "session",
        "scope",
        "id",
        "raw",
        "ask",
        "counts",
        "prompt_tokens",
        "outputs",
        "engine_prompt",
        "engine_generated",
        "last",
        "route",
        "upstream",
        "responded",
        "failed",
        "admitting",
    )

    def __init__(
        self,
        session: _Session,
        scope: CallScope,
        request_id: str,
        raw: bytes,
        ask: GenerationAsk | None,
        counts: EngineCounts | None,
    ) -> None:
        self.session = session
        self.scope = scope
        self.id = request_id
        self.raw = raw  # until it is sent upstream
        self.ask = ask  # what an LLM request asks of its engine (None: not an LLM's)
        self.counts = counts  # how its engine is asked for its token counts (None: not asked)
        self.prompt_tokens = 0 if ask is None else estimate_prompt_tokens(ask.prompt)
        self.outputs = 0  # an LLM request's responses that did not fail, so far
        # The engine's counts from its responses so far: its prompt, the tokens generated (-1: none read).
        self.engine_prompt = -1
        self.engine_generated = -1
        self.last: bytes | None = None  # the last of them
        self.route: Route | None = None
        self.upstream: ClientStream | None = None
        self.responded = False
        self.failed = False  # Triton answered with an error_message
        self.admitting: asyncio.Task[Admitted | BaseException] | None = None

    def admit(self, call: Call, cost: CallCost) -> None:
        """Admit and send at once when nothing waits (a free slot, quotas in this process);
        else when admission is done."""
        edge = self.session.handler.edge
        if edge.admits_in_process(self.scope.tenant):
            outcome = run_eagerly(self._admitted(call, cost))
            if not isinstance(outcome, asyncio.Task):
                self._send(outcome)
                return
            self.admitting = outcome
        else:  # a shared quota store: its client times out through the current task
            self.admitting = asyncio.ensure_future(self._admitted(call, cost))
        self.admitting.add_done_callback(self._admitted_later)

    async def _admitted(self, call: Call, cost: CallCost) -> Admitted | BaseException:
        try:
            return await self.session.handler.edge.admit(self.scope, call, cost)
        except Exception as e:  # refused (the table's code), or a bug (INTERNAL, logged)
            return e

    def _admitted_later(self, task: asyncio.Task[Admitted | BaseException]) -> None:
        self.admitting = None
        if task.cancelled():  # the stream ended while it waited
            self._close(errors.Cancelled("the stream ended"))
            return
        self._send(task.result())

    def _send(self, outcome: Admitted | BaseException) -> None:
        session = self.session
        raw, self.raw = self.raw, b""
        if isinstance(outcome, BaseException):
            session._refused(self.scope, self.id, outcome)
            session.finished(self)
            return
        route = self.route = outcome.route
        fragment = wire.dispatch_fragment(outcome.priority_level, outcome.timeout_us)
        counts = self.counts
        self.upstream = ClientStream(
            route.connections,
            PATH,
            (raw, fragment) if counts is None else (raw, counts.append, fragment),
            self,
            limit=session.limits.max_response_bytes,
            extra=(*session.extra, *outcome.trace),
            timeout_s=self.scope.timeout_s,
            failover=route.failover if route.can_fail_over else None,
        )
        if not session.flowing.is_set():
            self.hold()

    def hold(self) -> None:
        """The caller is not reading: take no more responses, give the slot back."""
        if self.upstream is not None:
            self.upstream.pause()
        self.scope.free_slot()

    def release(self) -> None:
        if self.upstream is not None:
            self.upstream.resume()

    # -- ClientSink ---------------------------------------------------------------------------

    def response(self, message: bytes) -> None:
        if wire.stream_response_failed(message):
            self.failed = True
        else:
            if not self.responded:
                self.responded = True
                self.scope.responded()  # an error names no model that exists
            if self.ask is not None:
                self.outputs += 1
                counts = self.counts
                if counts is not None:
                    prompt, generated, message = wire.response_counts(message, counts.strip)
                    if prompt >= 0:
                        self.engine_prompt = prompt
                    if generated >= 0:
                        self.engine_generated = max(self.engine_generated, 0) + generated
                self.last = message
        self.session.deliver(message)

    def charge(self, finished: bool) -> None:
        """An LLM request's real cost, settled in fair share, tokens per minute and the
        daily budget, as the generation API settles its calls: the engine's counts where
        they were asked for and came; else the prompt's estimate plus one generated token
        per streamed response with outputs (the engines stream one delta a step, unless
        they merge several), and for a request not streamed, max_tokens once it answered."""
        ask = self.ask
        if ask is None or self.route is None:  # not an LLM's, or it never reached one
            return
        # Only a request's last response may be Triton's empty final one: read it alone,
        # not every token's.
        outputs = self.outputs
        if self.last is not None and not wire.stream_response_has_outputs(self.last):
            outputs -= 1
        if self.engine_generated >= 0:
            completion = self.engine_generated
        else:
            completion = outputs if ask.streaming else (ask.max_tokens if outputs else 0)
        prompt = self.engine_prompt if self.engine_prompt >= 0 else self.prompt_tokens
        reason = ("length" if completion >= ask.max_tokens else "stop") if finished else "cancelled"
        self.scope.settle_tokens(self.id, prompt, completion, reason if outputs else None)

    def ended(self, status: int, trailers: Sequence[http2.Header]) -> None:
        session = self.session
        if self.route is not None:
            if status == UNAVAILABLE:
                self.route.recheck()  # it may have gone away: check it now
            self.route.done()
        self.charge(status == OK and not self.failed)
        if status == OK:
            # In-band errors carry no status code; the metric still must not say OK.
            session.settle(self.scope.close_now("UPSTREAM_ERROR" if self.failed else "OK"))
        else:
            session.settle(self.scope.close_now(code_name(status)))
            if session.close_on_error:
                session.end(trailers)
            else:
                session.deliver(_upstream_failure(self.id, status, trailers))
        self.upstream = None
        session.finished(self)

    # -- the stream ending -------------------------------------------------------------------

    def cancel(self) -> None:
        """The stream is over: the request is cancelled wherever it is."""
        if self.admitting is not None:
            self.admitting.cancel()  # its done callback closes the scope
            return
        upstream = self.upstream
        if upstream is not None and not upstream.ended:
            upstream.cancel()
            if self.route is not None:
                self.route.done()
            self.charge(False)  # what the engine did before the cancel
        self._close(errors.Cancelled("the stream ended"))

    def _close(self, error: BaseException) -> None:
        self.session.settle(self.scope.end(error))
        self.session.finished(self)
