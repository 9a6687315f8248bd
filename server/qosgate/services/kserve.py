"""`inference.GRPCInferenceService` (KServe v2), served as a drop-in for Triton.

Every RPC of the service but the two inference ones is handled here, registered with
bytes in and bytes out so the gateway forwards what the caller sent without decoding it.
ModelInfer and ModelStreamInfer never reach this server: the relay in front of it serves
them itself (relay/infer_policy.py, relay/stream_infer.py):

- model-scoped metadata (ModelReady/Metadata/Config/Statistics) and RepositoryIndex:
  forwarded after authentication, showing a tenant only its allowed models; asking about
  another model is PERMISSION_DENIED, whether or not it exists, so nothing leaks;
- shared memory, repository load/unload, trace and log settings: admin tenants only;
- server liveness, readiness and metadata: any authenticated tenant.

Upstream Triton errors go back with Triton's own code, details and trailers.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import grpc
from google.protobuf import message_factory
from tritonclient.grpc import service_pb2

from qosgate.auth import Tenant, TenantDirectory
from qosgate.error_table import bounded
from qosgate.services import edge
from qosgate.upstream import Upstream, UpstreamPool
from qosgate.kserve.names import INFER, METHODS, SERVICE, STREAM_INFER

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
# Served by the relay in front of this server (relay/infer_policy.py, relay/stream_infer.py).
RELAYED = frozenset({INFER, STREAM_INFER})
_REQUEST_TYPES = {
    m.name: message_factory.GetMessageClass(m.input_type)
    for m in service_pb2.DESCRIPTOR.services_by_name["GRPCInferenceService"].methods
}


class KServeService:
    """The KServe v2 service in front of an upstream pool; see the module docstring."""

    def __init__(self, *, directory: TenantDirectory, pool: UpstreamPool) -> None:
        self._directory = directory
        self._pool = pool

    # -- registration ---------------------------------------------------------------

    def methods(self) -> dict[str, edge.Method]:
        """Every method of the service, bytes in and bytes out, for `edge.Edge.handler`."""
        methods = {
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
        await context.abort(error.code(), bounded(error.details() or ""), error.trailing_metadata() or ())



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
