"""The gateway's policy for ModelInfer calls on the relay (`kserve_path: relay`).

The same steps, in the same order, as the grpcio path's ModelInfer (services/kserve.py):
identify → read the model from the first message → authorize → admit → wait for a
dispatch slot → append Triton's priority and timeout → forward; the slot and the quota
permit are released, and the metrics recorded, when the relay reports the call's end.
A refusal is answered by the relay with the error table's status and details
(services/status.py), without an upstream call.

Temporary twin of that path while the relay is behind a switch: issue 11 moves these steps
into the one data plane, which both front ends will call.
"""

from __future__ import annotations

import asyncio
import time
from contextlib import AbstractAsyncContextManager

from google.rpc import code_pb2

from qosgate import errors
from qosgate.auth import Tenant, TenantDirectory
from qosgate.clock import Clock
from qosgate.config import GatewayConfig
from qosgate.metrics import GatewayMetrics
from qosgate.quota import Admission, Refused
from qosgate.quota.verdict import Permit
from qosgate.relay.policy import CallEnd, CallHead, Decision, Forward, Refuse
from qosgate.relay.upstream import UpstreamPool
from qosgate.scheduler import Dispatch, Scheduler
from qosgate.scheduler.cost import unit_cost
from qosgate.services import infer_wire, status

RPC = "ModelInfer"
PRIORITY_HEADER = "x-priority"


class InferAdmissionPolicy:
    """Decides each relayed ModelInfer with the gateway's tenants, quotas and scheduler."""

    def __init__(
        self,
        *,
        config: GatewayConfig,
        directory: TenantDirectory,
        admission: Admission,
        scheduler: Scheduler,
        metrics: GatewayMetrics,
        clock: Clock,
        upstream: UpstreamPool,
        upstream_name: str,
        retry_after_s: float,
    ) -> None:
        self._config = config
        self._directory = directory
        self._admission = admission
        self._scheduler = scheduler
        self._metrics = metrics
        self._clock = clock
        self._pool = upstream
        self._upstream = upstream_name
        self._retry_after_s = retry_after_s
        self._releases: set[asyncio.Task[None]] = set()

    def __call__(self, head: CallHead) -> asyncio.Task[Decision]:
        return asyncio.ensure_future(self._decide(head))

    async def _decide(self, head: CallHead) -> Decision:
        labels = ["", "", ""]  # model, tenant, class: filled as they become known
        permit: Permit | None = None
        try:
            metadata = [
                (key.decode("latin-1"), value.decode("latin-1"))
                for key, value in head.headers
                if not key.startswith(b":") and not key.endswith(b"-bin")
            ]
            tenant = self._directory.identify(metadata)
            labels[1] = tenant.name
            request = _peek(head.first_message, self._config.limits.max_request_fields)
            self._directory.require_model(tenant, request.model_name)
            klass = self._directory.resolve_class(tenant, dict(metadata).get(PRIORITY_HEADER))
            labels[0], labels[2] = request.model_name, klass
            verdict = await self._admission.admit(tenant)
            if isinstance(verdict, Refused):
                raise verdict.error()
            permit = verdict.permit
            return await self._dispatch(head, tenant, request, klass, permit, labels)
        except asyncio.CancelledError:
            # The caller left or its deadline passed while queued (the slot removed itself).
            if permit is not None:
                await permit.release()
            self._metrics.request_done(RPC, labels[0], labels[1], labels[2], "CANCELLED")
            raise
        except Exception as e:  # refused (the table's code), or a bug (INTERNAL, logged)
            if permit is not None:
                await permit.release()
            row = status.row_of(e)
            if isinstance(e, errors.GatewayError):
                self._metrics.rejected(row.reason, labels[1], labels[2])
            self._metrics.request_done(RPC, labels[0], labels[1], labels[2], row.code.name)
            rich = status.to_rich_status(e)
            return Refuse(rich.code, rich.message, details=rich.SerializeToString())

    async def _dispatch(
        self,
        head: CallHead,
        tenant: Tenant,
        request: infer_wire.InferRequestHead,
        klass: str,
        permit: Permit,
        labels: list[str],
    ) -> Decision:
        model = request.model_name
        now = self._clock.now()
        deadline = None if head.timeout is None else now + head.timeout
        cost = unit_cost(
            self._config.model_policy(model).cost_unit, texts=request.rows, size=len(head.first_message)
        )
        slot = self._scheduler.slot(tenant=tenant, klass=klass, model=model, deadline=deadline, cost=cost)
        dispatch = await slot.__aenter__()
        self._metrics.queue_wait(klass, tenant.name, dispatch.queue_wait_s)
        if self._pool.pick() is None:
            await slot.__aexit__(None, None, None)
            raise errors.Unavailable("no healthy Triton upstream", retry_after_s=self._retry_after_s)
        fragment = infer_wire.priority_fragment(dispatch.priority_level)
        if deadline is not None:
            remaining = deadline - self._clock.now()
            if remaining <= 0:
                await slot.__aexit__(None, None, None)
                raise errors.DeadlineExceeded("deadline passed before dispatch to Triton")
            fragment += infer_wire.timeout_fragment(int(remaining * 1_000_000))
        started = time.perf_counter()

        def finished(end: CallEnd) -> None:
            if end.status == code_pb2.OK:
                dispatch.responded()
            code = "CANCELLED" if end.status is None else code_pb2.Code.Name(end.status)
            self._metrics.upstream_latency(self._upstream, model, time.perf_counter() - started)
            self._metrics.request_done(RPC, labels[0], labels[1], labels[2], code)
            task = asyncio.ensure_future(_release(slot, permit))
            self._releases.add(task)
            task.add_done_callback(self._releases.discard)

        return Forward(append=fragment, on_finish=finished)


async def _release(slot: AbstractAsyncContextManager[Dispatch], permit: Permit) -> None:
    try:
        await slot.__aexit__(None, None, None)
    finally:
        await permit.release()


def _peek(raw: bytes, max_fields: int) -> infer_wire.InferRequestHead:
    try:
        head = infer_wire.peek_request(raw, max_fields)
    except infer_wire.WireError as e:
        raise errors.InvalidArgument(f"malformed ModelInferRequest: {e}") from None
    if not head.model_name:
        raise errors.InvalidArgument("ModelInferRequest has no model_name")
    return head
