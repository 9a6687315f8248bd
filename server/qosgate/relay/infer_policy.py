"""The gateway's policy for ModelInfer calls on the relay, the KServe unary data path.

identify (key headers, or the client certificate of the TLS handshake) → read the model
from the first message → authorize → admit → wait for a dispatch slot → pick the upstream
(the model's routing policy over the live Tritons, upstream/pool.py) → append Triton's
priority and timeout → forward; the slot and the quota permit are released, and the
metrics recorded, when the relay reports the call's end. A call that its Triton fails
UNAVAILABLE (or drops) before any response goes once more to another live one
(`UpstreamPool.failover`). A refusal is answered by the relay with the error table's status
and details (services/status.py), without an upstream call.

Issue 11 moves these steps into the one data plane; until then they live here, in one
module, beside the stream pipeline of services/kserve.py that shares its helpers.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Mapping
from contextlib import AbstractAsyncContextManager

import grpc
from google.rpc import code_pb2

from qosgate import errors
from qosgate.auth import Tenant, TenantDirectory
from qosgate.clock import Clock
from qosgate.config import GatewayConfig
from qosgate.memory import HeapTrimmer
from qosgate.metrics import GatewayMetrics
from qosgate.quota import Admission, Refused
from qosgate.quota.verdict import Permit
from qosgate.relay import upstream as relay_upstream
from qosgate.relay.policy import CallEnd, CallHead, Decision, Forward, Refuse
from qosgate.scheduler import Dispatch, Scheduler
from qosgate.services import infer_wire, status
from qosgate.services.kserve import PRIORITY_HEADER, dispatch_fragment, peek_infer_request, request_cost
from qosgate.upstream import Upstream, UpstreamPool

RPC = "ModelInfer"


class InferAdmissionPolicy:
    """Decides each relayed ModelInfer with the gateway's tenants, quotas, scheduler and
    upstream routing; `connections` maps each upstream's name to the relay's pool of
    HTTP/2 connections to it."""

    def __init__(
        self,
        *,
        config: GatewayConfig,
        directory: TenantDirectory,
        admission: Admission,
        scheduler: Scheduler,
        metrics: GatewayMetrics,
        clock: Clock,
        pool: UpstreamPool,
        connections: Mapping[str, relay_upstream.UpstreamPool],
        heap: HeapTrimmer,
    ) -> None:
        self._config = config
        self._directory = directory
        self._admission = admission
        self._scheduler = scheduler
        self._metrics = metrics
        self._clock = clock
        self._pool = pool
        self._connections = connections
        self._heap = heap
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
            tenant = self._directory.identify(metadata, head.certificate)
            labels[1] = tenant.name
            request = peek_infer_request(head.first_message, self._config.limits.max_request_fields)
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
            self._heap.message(len(head.first_message))
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
        size = len(head.first_message)
        now = self._clock.now()
        deadline = None if head.timeout is None else now + head.timeout
        cost = request_cost(self._config, request, size)
        slot = self._scheduler.slot(tenant=tenant, klass=klass, model=model, deadline=deadline, cost=cost)
        dispatch = await slot.__aenter__()
        try:
            self._metrics.queue_wait(klass, tenant.name, dispatch.queue_wait_s)
            # Under prefix_affinity a KServe call is keyed by its session header only: the
            # gateway does not read tensors.
            header = self._pool.session_header(model)
            session = head.header(header.encode()) if header else None
            key = self._pool.key(model, session=session.decode("latin-1")) if session else None
            upstream = self._pool.pick(model, key=key)
            fragment = dispatch_fragment(
                dispatch.priority_level, None if deadline is None else deadline - self._clock.now()
            )
        except BaseException:
            await slot.__aexit__(None, None, None)
            raise
        call = _RoutedCall(self._pool, upstream, model, key)
        started = time.perf_counter()

        def finished(end: CallEnd) -> None:
            if end.status == code_pb2.OK:
                dispatch.responded()
            elif end.status == code_pb2.UNAVAILABLE:
                self._pool.recheck(call.upstream)  # it may have gone away: check it now
            code = "CANCELLED" if end.status is None else code_pb2.Code.Name(end.status)
            self._metrics.upstream_latency(call.upstream.name, model, time.perf_counter() - started)
            self._metrics.request_done(RPC, labels[0], labels[1], labels[2], code)
            self._heap.message(size)
            call.upstream.in_flight -= 1
            task = asyncio.ensure_future(_release(slot, permit))
            self._releases.add(task)
            task.add_done_callback(self._releases.discard)

        def failover() -> relay_upstream.UpstreamPool | None:
            other = call.failover()
            return None if other is None else self._connections[other.name]

        return Forward(
            append=fragment,
            on_finish=finished,
            upstream=self._connections[upstream.name],
            failover=failover if len(self._connections) > 1 else None,
        )


class _RoutedCall:
    """The upstream a call is at, counted in its load, and its one failover."""

    __slots__ = ("_pool", "upstream", "_model", "_key", "_retried")

    def __init__(self, pool: UpstreamPool, upstream: Upstream, model: str, key: bytes | None) -> None:
        self._pool = pool
        self.upstream = upstream
        self._model = model
        self._key = key
        self._retried = False
        upstream.in_flight += 1

    def failover(self) -> Upstream | None:
        if self._retried:
            return None
        self._retried = True
        other = self._pool.failover(self._model, self.upstream, grpc.StatusCode.UNAVAILABLE, key=self._key)
        if other is not None:
            self.upstream.in_flight -= 1
            other.in_flight += 1
            self.upstream = other
        return other


async def _release(slot: AbstractAsyncContextManager[Dispatch], permit: Permit) -> None:
    try:
        await slot.__aexit__(None, None, None)
    finally:
        await permit.release()
