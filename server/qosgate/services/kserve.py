"""`inference.GRPCInferenceService` (KServe v2), served as a drop-in for Triton.

Every RPC of the service is handled here, registered with bytes in and bytes out so the
gateway forwards what the caller sent without decoding tensors:

- ModelStreamInfer, per request inside the stream: identify (by `edge`, as for every
  RPC) → authorize → admit → schedule → dispatch (Triton `priority` and `timeout` appended
  to the request bytes) → forward; each request of a stream is a call of the data plane
  (dataplane/plane.py), which also counts and traces it. ModelInfer never reaches this
  server: the relay in front of it serves that RPC itself (relay/infer_policy.py, with
  the helpers here);
- model-scoped metadata (ModelReady/Metadata/Config/Statistics) and RepositoryIndex:
  forwarded after authentication, showing a tenant only its allowed models; asking about
  another model is PERMISSION_DENIED, whether or not it exists, so nothing leaks;
- shared memory, repository load/unload, trace and log settings: admin tenants only;
- server liveness, readiness and metadata: any authenticated tenant.

Upstream Triton errors go back with Triton's own code, details and trailers.
"""

from __future__ import annotations

import asyncio
import collections
import itertools
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field
from typing import Any

import grpc
from google.protobuf import message_factory
from tritonclient.grpc import service_pb2

from qosgate import errors
from qosgate.auth import Tenant, TenantDirectory
from qosgate.clock import Clock
from qosgate.config import GatewayConfig
from qosgate.dataplane.plane import CallCost, CallScope, DataPlane
from qosgate.memory import HeapTrimmer
from qosgate.metrics import GatewayMetrics
from qosgate.quota import Admission, Refused, StreamLimiter
from qosgate.scheduler import Scheduler
from qosgate.scheduler.cost import unit_cost
from qosgate.services import edge, infer_wire, status
from qosgate.services.headers import text_headers
from qosgate.upstream import Upstream, UpstreamPool
from qosgate.upstream.pool import METHODS, SERVICE

PRIORITY_HEADER = "x-priority"
# Each request inside a stream is a data-plane call of this name (the `rpc` label).
STREAM_RPC = "ModelStreamInfer"
# Triton closes a stream at its first error when the caller sends this header; the
# gateway then does the same for its own refusals.
GRPC_ERROR_HEADER = "triton_grpc_error"

ADMIN_ONLY = frozenset(
    {
        "RepositoryModelLoad",
        "RepositoryModelUnload",
        "SystemSharedMemoryStatus",
        "SystemSharedMemoryRegister",
        "SystemSharedMemoryUnregister",
        "CudaSharedMemoryStatus",
        "CudaSharedMemoryRegister",
        "CudaSharedMemoryUnregister",
        "TraceSetting",
        "LogSettings",
    }
)
OPEN = frozenset({"ServerLive", "ServerReady", "ServerMetadata"})
REPOSITORY_CHANGES = frozenset({"RepositoryModelLoad", "RepositoryModelUnload"})
# Requests that name one model (`name`).
MODEL_SCOPED = frozenset({"ModelReady", "ModelMetadata", "ModelConfig"})
# Served by the relay in front of this server (relay/infer_policy.py).
RELAYED = frozenset({"ModelInfer"})
_REQUEST_TYPES = {
    m.name: message_factory.GetMessageClass(m.input_type)
    for m in service_pb2.DESCRIPTOR.services_by_name["GRPCInferenceService"].methods
}


class KServeService:
    """The KServe v2 service in front of an upstream pool; see the module docstring."""

    def __init__(
        self,
        *,
        config: GatewayConfig,
        plane: DataPlane,
        directory: TenantDirectory,
        admission: Admission,
        scheduler: Scheduler,
        pool: UpstreamPool,
        metrics: GatewayMetrics,
        clock: Clock,
        streams: StreamLimiter,
        heap: HeapTrimmer,
    ) -> None:
        self._config = config
        self._plane = plane
        self._directory = directory
        self._admission = admission
        self._scheduler = scheduler
        self._pool = pool
        self._metrics = metrics
        self._clock = clock
        self._limits = config.limits
        self._streams = streams
        self._heap = heap
        self._stream_ids = itertools.count(1)

    # -- registration ---------------------------------------------------------------

    def methods(self) -> dict[str, edge.Method]:
        """Every method of the service, bytes in and bytes out, for `edge.Edge.handler`."""
        methods = {
            "ModelStreamInfer": edge.Method(
                self._model_stream_infer, client_streaming=True, server_streaming=True
            ),
            "RepositoryIndex": self._metadata_rpc(
                "RepositoryIndex", _anyone, _visible_only(service_pb2.RepositoryIndexResponse, "models")
            ),
            "ModelStatistics": self._metadata_rpc(
                "ModelStatistics",
                self._named_model_if_any,
                _visible_only(service_pb2.ModelStatisticsResponse, "model_stats"),
            ),
        }
        for method in MODEL_SCOPED:
            methods[method] = self._metadata_rpc(method, self._named_model)
        for method in ADMIN_ONLY:
            methods[method] = self._metadata_rpc(method, self._admin(method))
        for method in OPEN:
            methods[method] = self._metadata_rpc(method, _anyone)
        missing = set(METHODS) - set(methods) - RELAYED
        if missing:  # a newer tritonclient added an RPC: refuse to start rather than 501 it
            raise RuntimeError(f"no handler for {SERVICE} methods {sorted(missing)}")
        return methods

    # -- metadata and admin RPCs -----------------------------------------------------

    def _metadata_rpc(
        self, method: str, check: _Check, reply_filter: _ReplyFilter | None = None
    ) -> edge.Method:
        """Parse (Triton must never see bytes it cannot parse), `check` the request, forward
        the bytes as they came, and pass the reply through `reply_filter`."""
        parse = edge.parser(_REQUEST_TYPES[method])

        async def handle(tenant: Tenant, request: bytes, context: grpc.aio.ServicerContext) -> bytes:
            check(tenant, parse(request))
            reply = await self._forward(method, request, context)
            return reply if reply_filter is None else reply_filter(tenant, reply)

        return edge.Method(handle)

    def _admin(self, method: str) -> _Check:
        return lambda tenant, _request: self._directory.require_admin(tenant, method)

    def _named_model(self, tenant: Tenant, request: Any) -> None:
        self._directory.require_model(tenant, request.name)

    def _named_model_if_any(self, tenant: Tenant, request: Any) -> None:
        if request.name:  # empty asks for every model: the reply is filtered instead
            self._directory.require_model(tenant, request.name)

    async def _forward(self, method: str, request: bytes, context: grpc.aio.ServicerContext) -> bytes:
        upstream = self._pool.pick()
        with upstream.lease():
            try:
                return await upstream.unary(method)(request, timeout=context.time_remaining())
            except grpc.aio.AioRpcError as e:
                await self._pass_through(upstream, e, context)
                raise  # unreachable: abort raises
            finally:
                if method in REPOSITORY_CHANGES:
                    self._pool.recheck(upstream)  # its ready models changed, or may have

    async def _pass_through(
        self, upstream: Upstream, error: grpc.aio.AioRpcError, context: grpc.aio.ServicerContext
    ) -> None:
        if error.code() is grpc.StatusCode.UNAVAILABLE:
            # The upstream may have gone away: check it now, not at the next poll.
            self._pool.recheck(upstream)
        await context.abort(error.code(), status.bounded(error.details() or ""), error.trailing_metadata() or ())

    # -- inference ---------------------------------------------------------------------

    async def _model_stream_infer(
        self, tenant: Tenant, requests: AsyncIterator[bytes], context: grpc.aio.ServicerContext
    ) -> None:
        await _StreamSession(self, tenant, requests, context).run()


def peek_infer_request(raw: bytes, max_fields: int) -> infer_wire.InferRequestHead:
    """The routing fields of a ModelInferRequest; INVALID_ARGUMENT if it does not parse."""
    try:
        head = infer_wire.peek_request(raw, max_fields)
    except infer_wire.WireError as e:
        raise errors.InvalidArgument(f"malformed ModelInferRequest: {e}") from None
    if not head.model_name:
        raise errors.InvalidArgument("ModelInferRequest has no model_name")
    return head


def request_cost(config: GatewayConfig, head: infer_wire.InferRequestHead, size: int) -> float:
    """What a KServe request of `size` bytes costs in fair share (its model's cost unit)."""
    return unit_cost(config.model_policy(head.model_name).cost_unit, texts=head.rows, size=size)


def dispatch_fragment(level: int, remaining_s: float | None) -> bytes:
    """The bytes appended to a request at dispatch: Triton's priority `level`, and its
    timeout from the seconds left to the deadline (DEADLINE_EXCEEDED if none are)."""
    fragment = infer_wire.priority_fragment(level)
    if remaining_s is None:
        return fragment
    if remaining_s <= 0:
        raise errors.DeadlineExceeded("deadline passed before dispatch to Triton")
    return fragment + infer_wire.timeout_fragment(int(remaining_s * 1_000_000))


_Check = Callable[[Tenant, Any], None]
_ReplyFilter = Callable[[Tenant, bytes], bytes]


def _anyone(_tenant: Tenant, _request: Any) -> None:
    """Any authenticated tenant may call."""


def _visible_only(response_type: type[Any], field_name: str) -> _ReplyFilter:
    """Keep only the entries of a repeated field whose `name` the tenant may see."""

    def keep_visible(tenant: Tenant, reply: bytes) -> bytes:
        message = response_type.FromString(reply)
        entries = getattr(message, field_name)
        visible = [e for e in entries if tenant.allows_model(e.name)]
        del entries[:]
        entries.extend(visible)
        return message.SerializeToString()

    return keep_visible




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


def _stream_error(request_id: str, message: str) -> bytes:
    return service_pb2.ModelStreamInferResponse(
        error_message=message, infer_response=service_pb2.ModelInferResponse(id=request_id)
    ).SerializeToString()


class _StreamSession:
    """One ModelStreamInfer call: one upstream stream, each request scheduled on its own.

    Requests get a gateway id on their way up (appended; the caller's id comes back
    appended to each response), so responses of interleaved requests can be matched to
    the request holding the dispatch slot. Triton is asked for an empty final response so
    that a decoupled model's end is always seen; callers that did not ask for it do not
    get it. A refusal of one request is reported in the stream, as Triton reports a
    failed request, and the stream goes on.

    Each request is a call of the data plane (`CallScope`): admitted, scheduled, counted
    and traced like any other API's call, closed when its final response arrives.

    Everything a stream holds is bounded (`limits`): responses waiting for the caller
    (`stream_buffer_bytes`) and requests read and not finished (`stream_max_pending`).
    While the caller does not read, the session stops reading Triton's responses and the
    caller's requests, and its requests at Triton give their dispatch slots back
    (`CallScope.free_slot`).
    """

    def __init__(
        self,
        service: KServeService,
        tenant: Tenant,
        requests: AsyncIterator[bytes],
        context: grpc.aio.ServicerContext,
    ) -> None:
        self._svc = service
        self._tenant = tenant
        self._requests = requests
        self._context = context
        self._metadata = text_headers(context)
        self._outbox = _Outbox(service._limits.stream_buffer_bytes)
        self._in_flight: dict[str, _InFlight] = {}
        self._tasks: set[asyncio.Task[None]] = set()
        self._write_lock = asyncio.Lock()
        self._upstream_error: grpc.aio.AioRpcError | None = None
        self._fatal: Exception | None = None
        self._close_on_error = self._metadata.get(GRPC_ERROR_HEADER, "").lower() == "true"
        self._prefix = f"qg{next(service._stream_ids)}-"
        self._upstream_name = ""
        self._ids = itertools.count(1)

    async def run(self) -> None:
        svc = self._svc
        try:
            upstream = svc._pool.pick()
            opened = svc._streams.open(self._tenant)
            if isinstance(opened, Refused):
                raise opened.error()
        except errors.GatewayError as e:  # answered by the edge; counted as a refused call
            await svc._plane.open(STREAM_RPC, self._tenant, "", self._metadata).close(e)
            raise
        try:
            await self._relay(upstream)
        finally:
            await opened.permit.release()

    async def _relay(self, upstream: Upstream) -> None:
        svc, context = self._svc, self._context
        forwarded = (
            ((GRPC_ERROR_HEADER, self._metadata[GRPC_ERROR_HEADER]),) if self._close_on_error else None
        )
        self._upstream_name = upstream.name
        with upstream.lease():
            call = upstream.stream()(timeout=context.time_remaining(), metadata=forwarded)
            pump = asyncio.create_task(self._pump(call))
            reader = asyncio.create_task(self._read(call))
            try:
                while (item := await self._outbox.get()) is not None:
                    await context.write(item)
                if self._fatal is not None:
                    await status.abort(context, self._fatal)
                if self._upstream_error is not None:
                    await svc._pass_through(upstream, self._upstream_error, context)
            finally:
                # The caller left (or we are done): stop reading it, drop its queued
                # requests, and cancel the upstream stream so Triton stops generating.
                for task in (pump, reader, *self._tasks):
                    task.cancel()
                call.cancel()
                await asyncio.gather(pump, reader, *self._tasks, return_exceptions=True)

    async def _pump(self, call: grpc.aio.StreamStreamCall) -> None:
        pending = asyncio.Semaphore(self._svc._limits.stream_max_pending)
        requests = aiter(self._requests)
        try:
            while True:
                # A caller that does not read its responses gets no more requests read.
                await self._outbox.flowing.wait()
                await pending.acquire()
                try:
                    raw = await anext(requests)
                except StopAsyncIteration:
                    break
                self._svc._heap.message(len(raw))
                task = asyncio.create_task(self._serve(call, raw))
                del raw  # held by the task only, until it is sent upstream
                self._tasks.add(task)
                task.add_done_callback(self._tasks.discard)
                task.add_done_callback(lambda _: pending.release())
            # The caller half-closed: once its requests are finished, so do we upstream.
            while self._tasks:
                await asyncio.gather(*self._tasks, return_exceptions=True)
            await call.done_writing()
        except grpc.aio.AioRpcError:
            pass  # the upstream stream failed; the reader reports it

    async def _serve(self, call: grpc.aio.StreamStreamCall, raw: bytes) -> None:
        """One request of the stream: a call of the data plane of its own, its refusal
        answered in the stream (or ending it, under `triton_grpc_error`)."""
        svc = self._svc
        malformed: errors.InvalidArgument | None = None
        try:
            head = peek_infer_request(raw, svc._limits.max_request_fields)
        except errors.InvalidArgument as e:  # a call of no model, refused like any other
            head, malformed = infer_wire.InferRequestHead(), e
        try:
            async with svc._plane.call(STREAM_RPC, self._tenant, head.model_name, self._metadata) as scope:
                if malformed is not None:
                    raise malformed
                # Nothing of a stream whose caller is not reading is admitted.
                await self._outbox.flowing.wait()
                dispatching = self._dispatch(scope, call, head, raw)
                del raw  # held by `_dispatch` only, which lets go of it once it is sent
                await dispatching
        except Exception as e:  # refused (the table's code), or a bug (INTERNAL, logged)
            if self._close_on_error:
                self._fatal = e
                self._outbox.close()
            else:
                await self._outbox.put(_stream_error(head.id, status.stream_error_message(e)))

    async def _dispatch(
        self, scope: CallScope, call: grpc.aio.StreamStreamCall, head: infer_wire.InferRequestHead, raw: bytes
    ) -> None:
        """Admit the request, send it up the stream and wait for its final response; the
        reader (`_read`) reports its responses to the scope."""
        svc = self._svc
        cost = CallCost(fair_share=request_cost(svc._config, head, len(raw)))
        deadline = svc._plane.deadline(self._context.time_remaining())
        dispatch = await scope.admit(cost, priority_class=self._metadata.get(PRIORITY_HEADER), deadline=deadline)
        fragment = infer_wire.priority_fragment(dispatch.priority_level)
        if scope.timeout_us is not None:
            fragment += infer_wire.timeout_fragment(scope.timeout_us)
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
                        raw + fragment + infer_wire.id_fragment(gateway_id) + infer_wire.empty_final_fragment()
                    )
            except grpc.aio.AioRpcError as e:
                # The upstream stream failed under us: the reader reports it to the caller.
                await scope.close_with_code(e.code().name, e)
                return
            del raw  # sent: a request waiting at Triton does not keep its bytes here
            await entry.done.wait()
        finally:
            self._in_flight.pop(gateway_id, None)
        if entry.failed:
            # In-band errors carry no status code; the metric still must not say OK.
            await scope.close_with_code("UPSTREAM_ERROR")

    async def _read(self, call: grpc.aio.StreamStreamCall) -> None:
        try:
            async for raw in call:
                head = infer_wire.peek_stream_response(raw)
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
                await self._deliver(raw + infer_wire.stream_response_id_fragment(entry.client_id))
        except grpc.aio.AioRpcError as e:
            # Any end but OK goes to the caller, CANCELLED included (Triton gave up on the
            # stream): only this session cancels the call itself, and then nobody listens.
            self._upstream_error = e
        finally:
            # Requests Triton did not finish: failed if the upstream stream did.
            for entry in self._in_flight.values():
                entry.end(failed=self._upstream_error is not None)
            self._outbox.close()

    async def _deliver(self, response: bytes) -> None:
        """Queue a response for the caller; while its buffer is full, stop reading Triton."""
        if self._outbox.full():
            # The caller is not reading: its requests at Triton give their slots back
            # rather than hold the model's window while this stream waits.
            for entry in self._in_flight.values():
                entry.scope.free_slot()
        self._svc._heap.message(len(response))
        await self._outbox.put(response)
