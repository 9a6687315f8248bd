"""The gateway's policy for ModelInfer calls on the relay, the KServe unary data path: the
front end that decodes a call for the edge (qosgate.edge), and forwards it as frames.

decode (key headers, class, deadline; the model from the first message) → the edge
(identify, authorize, admit, dispatch slot, deadline, route) → append Triton's priority
and timeout, set the upstream span's `traceparent`, drop the caller's credential headers →
forward to the route's upstream. The call's scope is closed, releasing its slot and
permit and recording its metrics and span, when the relay reports the call's end. A call
that its Triton fails before any response goes once more where its route fails over to
(`Forward.failover`). A refusal is answered by the relay with the error table's status
and details (transport/status.py), without an upstream call.
"""

from __future__ import annotations

import asyncio
from collections.abc import Coroutine
from typing import Any, TypeVar

from qosgate import errors
from qosgate.auth import Tenant
from qosgate.config import CostUnit
from qosgate.dataplane.call import Call
from qosgate.dataplane.plane import CallCost, CallScope
from qosgate.eager import run_eagerly
from qosgate.edge import CREDENTIALS, Edge
from qosgate.kserve import wire
from qosgate.kserve.names import INFER
from qosgate.kserve.wire import InferRequestHead
from qosgate.memory import HeapTrimmer
from qosgate.relay.policy import CallEnd, CallHead, Decision, Forward, call_of
from qosgate.scheduler.cost import unit_cost
from qosgate.transport.status import OK, UNAVAILABLE, code_name, refusal

T = TypeVar("T")


class InferAdmissionPolicy:
    """Decides each relayed ModelInfer through the edge (see the module)."""

    def __init__(self, *, edge: Edge, heap: HeapTrimmer, max_request_fields: int) -> None:
        self._edge = edge
        self._heap = heap
        self._max_fields = max_request_fields
        self._closing: set[asyncio.Future[None]] = set()

    def __call__(self, head: CallHead) -> Decision | asyncio.Task[Decision]:
        call = call_of(INFER, head.headers, head.caller, head.timeout)
        try:
            tenant = self._edge.identify(call)
        except errors.GatewayError as e:  # counted by the edge
            self._heap.message(len(head.first_message))
            return refusal(e)
        return self._start(self._decide(head, call), tenant)

    def _start(self, coro: Coroutine[Any, Any, T], tenant: Tenant) -> T | asyncio.Task[T]:
        """Run `coro` at once, its result without a task when it does not wait (the common
        case: admission in process, a free slot); where `tenant`'s quotas are counted in a
        shared store (Redis, whose client times out through the current task) as a task."""
        if self._edge.admits_in_process(tenant):
            return run_eagerly(coro)
        return asyncio.ensure_future(coro)

    async def _decide(self, head: CallHead, call: Call) -> Decision:
        edge = self._edge
        scope: CallScope | None = None
        try:
            request = peek_infer_request(head.first_message, self._max_fields)
            call.model = request.model_name
            scope = edge.open(call)
            return await self._dispatch(head, call, request, scope)
        except asyncio.CancelledError as e:  # the caller left, or its deadline passed while queued
            await (scope or edge.open(call)).close(e)
            raise
        except Exception as e:  # refused (the table's code), or a bug (INTERNAL, logged)
            await (scope or edge.open(call)).close(e)
            self._heap.message(len(head.first_message))
            return refusal(e)

    async def _dispatch(self, head: CallHead, call: Call, request: InferRequestHead, scope: CallScope) -> Decision:
        size = len(head.first_message)
        edge = self._edge
        cost = CallCost(fair_share=request_cost(edge.models.cost_unit(call.model), request, size))
        admitted = await edge.admit(scope, call, cost)
        fragment = wire.dispatch_fragment(admitted.priority_level, admitted.timeout_us)
        route = admitted.route

        def finished(end: CallEnd) -> None:
            if end.status == OK:
                scope.responded()
            elif end.status == UNAVAILABLE:
                route.recheck()  # it may have gone away: check it now
            code = "CANCELLED" if end.status is None else code_name(end.status)
            route.done()
            self._heap.message(size)
            pending = scope.close_now(code)
            if pending is not None:  # it waits (a shared quota store): keep it until done
                closing = asyncio.ensure_future(pending)
                self._closing.add(closing)
                closing.add_done_callback(self._closing.discard)

        return Forward(
            set_headers=admitted.trace,
            drop_headers=CREDENTIALS,
            append=fragment,
            on_finish=finished,
            upstream=route.connections,
            failover=route.failover if route.can_fail_over else None,
        )


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
