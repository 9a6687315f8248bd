"""The gateway's policy for ModelInfer calls on the relay, the KServe unary data path: a
thin adapter onto the data plane (dataplane/plane.py).

identify (key headers, or the client certificate of the TLS handshake) → read the model
from the first message → the data plane's path (authorize, admit, dispatch slot, deadline)
→ pick the upstream (the model's routing policy over the live Tritons, upstream/pool.py)
→ append Triton's priority and timeout, set the upstream span's `traceparent`, drop the
caller's credential headers → forward.
The call's scope is closed, releasing its slot and permit and recording its metrics and
span, when the relay reports the call's end. A call that its Triton fails UNAVAILABLE (or
drops) before any response goes once more to another live one (`UpstreamPool.failover`).
A refusal is answered by the relay with the error table's status and details
(services/status.py), without an upstream call.
"""

from __future__ import annotations

import asyncio
from collections.abc import Coroutine, Mapping
from typing import Any, TypeVar

import grpc
from google.rpc import code_pb2

from qosgate import errors
from qosgate.error_table import row_of
from qosgate.auth import API_KEY, AUTHORIZATION
from qosgate.config import CostUnit, GatewayConfig
from qosgate.dataplane.plane import CallCost, CallScope, DataPlane
from qosgate.dataplane.tracing import TRACEPARENT, TRACESTATE
from qosgate.eager import run_eagerly
from qosgate.memory import HeapTrimmer
from qosgate.kserve.names import INFER, PRIORITY_HEADER
from qosgate.relay.policy import CallEnd, CallHead, Decision, Forward
from qosgate.transport.status import code_name, refusal
from qosgate.upstream.connections import ConnectionPool
from qosgate.scheduler.cost import unit_cost
from qosgate.kserve import wire
from qosgate.kserve.wire import InferRequestHead
from qosgate.upstream import Upstream, UpstreamPool

RPC = INFER
# The headers the policy reads: credentials (never sent on to Triton: a tenant's key is the
# gateway's business, and an upstream link may be plaintext); priority class and the
# caller's trace context.
_CREDENTIALS = frozenset(name.encode() for name in (AUTHORIZATION, API_KEY))
_READ = frozenset(name.encode() for name in (PRIORITY_HEADER, TRACEPARENT, TRACESTATE))
T = TypeVar("T")


class InferAdmissionPolicy:
    """Decides each relayed ModelInfer through the data plane and the upstream routing;
    `connections` maps each upstream's name to the relay's pool of HTTP/2 connections."""

    def __init__(
        self,
        *,
        config: GatewayConfig,
        plane: DataPlane,
        pool: UpstreamPool,
        connections: Mapping[str, ConnectionPool],
        heap: HeapTrimmer,
    ) -> None:
        self._config = config
        self._plane = plane
        self._pool = pool
        self._connections = connections
        self._heap = heap
        self._closing: set[asyncio.Task[None]] = set()
        self._models = ModelFacts(config)

    def __call__(self, head: CallHead) -> Decision | asyncio.Task[Decision]:
        return self._start(self._decide(head))

    def _start(self, coro: Coroutine[Any, Any, T]) -> T | asyncio.Task[T]:
        """Run `coro` at once, its result without a task when it does not wait (the common
        case: admission in process, a free slot); with a shared quota store (Redis, whose
        client times out through the current task) always as a task."""
        if self._plane.admission.in_process:
            return run_eagerly(coro)
        return asyncio.ensure_future(coro)

    async def _decide(self, head: CallHead) -> Decision:
        # Only the headers the policy reads are decoded; the rest go to Triton as they came.
        credentials = tuple(pair for pair in head.headers if pair[0] in _CREDENTIALS)
        headers = {key.decode("latin-1"): value.decode("latin-1") for key, value in head.headers if key in _READ}
        try:
            tenant = self._plane.directory.identify_on(head.caller, credentials)
        except errors.GatewayError as e:  # no tenant, so no scope: counted here as before
            row = row_of(e)
            self._plane.metrics.rejected(row.reason, "", "")
            self._plane.metrics.request_done(RPC, "", "", "", row.code)
            self._heap.message(len(head.first_message))
            return refusal(e)
        scope: CallScope | None = None
        try:
            request = peek_infer_request(head.first_message, self._config.limits.max_request_fields)
            scope = self._plane.open(RPC, tenant, request.model_name, headers)
            return await self._dispatch(head, headers, request, scope)
        except asyncio.CancelledError as e:  # the caller left, or its deadline passed while queued
            await (scope or self._plane.open(RPC, tenant, "", headers)).close(e)
            raise
        except Exception as e:  # refused (the table's code), or a bug (INTERNAL, logged)
            await (scope or self._plane.open(RPC, tenant, "", headers)).close(e)
            self._heap.message(len(head.first_message))
            return refusal(e)

    async def _dispatch(
        self, head: CallHead, headers: dict[str, str], request: InferRequestHead, scope: CallScope
    ) -> Decision:
        model = request.model_name
        size = len(head.first_message)
        facts = self._models
        cost = CallCost(fair_share=request_cost(facts.cost_unit(model), request, size))
        dispatch = await scope.admit(
            cost, priority_class=headers.get(PRIORITY_HEADER), deadline=self._plane.deadline(head.timeout)
        )
        # Under prefix_affinity a KServe call is keyed by its session header only: the
        # gateway does not read tensors.
        header = facts.session_header(model)
        value = head.header(header) if header is not None else None
        session = value.decode("latin-1") if value is not None else None
        key = self._pool.key(model, session=session) if session else None
        fragment = dispatch_fragment(dispatch.priority_level, scope.timeout_s)
        call = _RoutedCall(self._pool, self._pool.pick(model, key=key), model, key, scope)

        def finished(end: CallEnd) -> None:
            if end.status == code_pb2.OK:
                scope.responded()
            elif end.status == code_pb2.UNAVAILABLE:
                self._pool.recheck(call.upstream)  # it may have gone away: check it now
            code = "CANCELLED" if end.status is None else code_name(end.status)
            call.done()
            self._heap.message(size)
            pending = scope.close_now(code)
            if pending is not None:  # it waits (a shared quota store): keep it until done
                closing = asyncio.ensure_future(pending)
                self._closing.add(closing)
                closing.add_done_callback(self._closing.discard)

        def failover() -> ConnectionPool | None:
            other = call.failover()
            return None if other is None else self._connections[other.name]

        return Forward(
            set_headers=[(k.encode(), v.encode()) for k, v in scope.upstream_headers()],
            drop_headers=_CREDENTIALS,
            append=fragment,
            on_finish=finished,
            upstream=self._connections[call.upstream.name],
            failover=failover if len(self._connections) > 1 else None,
        )


class ModelFacts:
    """What the relay reads of a model's policy on every call, from plain dicts: the
    config's own lookups (pydantic models, a routing callable) run interpreted and cost
    more than the rest of a call's routing."""

    __slots__ = ("_units", "_default_unit", "_session_headers", "_default_session_header")

    def __init__(self, config: GatewayConfig) -> None:
        models, default = config.models, config.default_model_policy
        self._units = {name: policy.cost_unit for name, policy in models.items()}
        self._default_unit: CostUnit = default.cost_unit
        self._session_headers = {name: _header_name(policy.routing.session_header) for name, policy in models.items()}
        self._default_session_header = _header_name(default.routing.session_header)

    def cost_unit(self, model: str) -> CostUnit:
        """The unit `model`'s calls are charged in (ModelPolicy.cost_unit)."""
        return self._units.get(model, self._default_unit)

    def session_header(self, model: str) -> bytes | None:
        """The header (lower-case) `model`'s routing reads a session id from, if any."""
        return self._session_headers.get(model, self._default_session_header)


def _header_name(name: str | None) -> bytes | None:
    return None if name is None else name.encode("latin-1")  # lower case (the config says so)


class _RoutedCall:
    """The upstream a call is at, counted in its load and reported to the call's scope
    (one upstream attempt each), and its one failover."""

    __slots__ = ("_pool", "upstream", "_model", "_key", "_retried", "_scope")

    def __init__(self, pool: UpstreamPool, upstream: Upstream, model: str, key: bytes | None, scope: CallScope) -> None:
        self._pool = pool
        self.upstream = upstream
        self._model = model
        self._key = key
        self._retried = False
        self._scope = scope
        upstream.in_flight += 1
        scope.upstream_started(upstream.name)

    def failover(self) -> Upstream | None:
        if self._retried:
            return None
        self._retried = True
        other = self._pool.failover(self._model, self.upstream, grpc.StatusCode.UNAVAILABLE, key=self._key)
        if other is not None:
            self.done()
            other.in_flight += 1
            self.upstream = other
            self._scope.upstream_started(other.name)
        return other

    def done(self) -> None:
        self.upstream.in_flight -= 1
        self._scope.upstream_finished()


def peek_infer_request(raw: bytes | memoryview, max_fields: int) -> InferRequestHead:
    """The routing fields of a ModelInferRequest; INVALID_ARGUMENT if it does not parse."""
    try:
        head = wire.peek_request(raw, max_fields)
    except wire.WireError as e:
        raise errors.InvalidArgument(f"malformed ModelInferRequest: {e}") from None
    if not head.model_name:
        raise errors.InvalidArgument("ModelInferRequest has no model_name")
    return head


def request_cost(unit: CostUnit, head: InferRequestHead, size: int) -> float:
    """What a KServe request of `size` bytes costs in fair share, in its model's cost `unit`."""
    # The rows are read only where they are the cost: reading them walks into the inputs.
    return unit_cost(unit, texts=head.rows if unit == "text" else 1, size=size)


def dispatch_fragment(level: int, remaining_s: float | None) -> bytes:
    """The bytes appended to a request at dispatch: Triton's priority `level`, and its
    timeout from the seconds left to the deadline (DEADLINE_EXCEEDED if none are)."""
    fragment = wire.priority_fragment(level)
    if remaining_s is None:
        return fragment
    if remaining_s <= 0:
        raise errors.DeadlineExceeded("deadline passed before dispatch to Triton")
    return fragment + wire.timeout_fragment(int(remaining_s * 1_000_000))

