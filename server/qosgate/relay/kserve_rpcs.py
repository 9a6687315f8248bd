"""`inference.GRPCInferenceService` (KServe v2) but its inference RPCs, served by the relay
as a drop-in for Triton, over the same upstream connections as every other call.

Each call's caller is identified by the edge first; its request is then parsed (Triton must
never see bytes it cannot parse: INVALID_ARGUMENT), checked, and forwarded as the bytes
it came as to a live Triton (connections.ClientStream, failed over like any call); the
reply comes back filtered where the tenant may see part of it only:

- model-scoped metadata (ModelReady/Metadata/Config/Statistics) and RepositoryIndex: a
  tenant sees only its allowed models; asking about another model is PERMISSION_DENIED,
  whether or not it exists, so nothing leaks;
- shared memory, repository load/unload, trace and log settings: admin tenants only;
- server liveness, readiness and metadata: any authenticated tenant.

Triton's errors go back with Triton's own code, message (cut to 1 KiB) and details.
ModelInfer and ModelStreamInfer are the relay's own paths (infer_policy.py, stream_infer.py).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any, cast

from google.protobuf import message_factory
from google.protobuf.descriptor import Descriptor
from google.protobuf.message import DecodeError
from tritonclient.grpc import service_pb2

from qosgate import errors
from qosgate.auth import Tenant, TenantDirectory
from qosgate.edge import Edge
from qosgate.kserve import wire
from qosgate.kserve.names import INFER, METHODS, SERVICE, STREAM_INFER, path
from qosgate.relay.messages import OK_STATUS, ServerStream
from qosgate.relay.policy import call_of
from qosgate.transport import http2
from qosgate.transport.messages import StreamError
from qosgate.transport.status import OK, UNIMPLEMENTED, Refuse, refusal, status_headers
from qosgate.upstream.engine import Engine

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
# The relay's own paths, not served here.
RELAYED = frozenset({INFER, STREAM_INFER})
_REQUEST_TYPES = {
    m.name: message_factory.GetMessageClass(m.input_type)
    for m in service_pb2.DESCRIPTOR.services_by_name["GRPCInferenceService"].methods
}
PREFIX = f"/{SERVICE}/".encode()

_Check = Callable[[Tenant, Any], None]
_ReplyFilter = Callable[[Tenant, bytes], bytes]


class KServeRpcs:
    """Serves the KServe RPCs above (a messages.Handler for the service's path prefix)."""

    def __init__(self, *, edge: Edge, engine: Engine, directory: TenantDirectory, max_request_fields: int) -> None:
        self._edge = edge
        self._engine = engine
        self._directory = directory
        self._max_fields = max_request_fields
        self._methods: dict[str, tuple[_Check, _ReplyFilter | None]] = {
            "RepositoryIndex": (_anyone, _visible_only(service_pb2.RepositoryIndexResponse, "models")),
            "ModelStatistics": (
                self._named_model_if_any,
                _visible_only(service_pb2.ModelStatisticsResponse, "model_stats"),
            ),
        }
        for method in MODEL_SCOPED:
            self._methods[method] = (self._named_model, None)
        for method in ADMIN_ONLY:
            self._methods[method] = (self._admin(method), None)
        for method in OPEN:
            self._methods[method] = (_anyone, None)
        missing = set(METHODS) - set(self._methods) - RELAYED
        if missing:  # a newer tritonclient added an RPC: refuse to start rather than 501 it
            raise RuntimeError(f"no handler for {SERVICE} methods {sorted(missing)}")

    async def __call__(self, stream: ServerStream) -> Sequence[http2.Header]:
        method = (http2.header(stream.headers, b":path") or b"")[len(PREFIX) :].decode("latin-1")
        found = self._methods.get(method)
        if found is None:
            return status_headers(Refuse(UNIMPLEMENTED, f"unknown method {method!r} of {SERVICE}"))
        check, reply_filter = found
        call = call_of(method, stream.headers, stream.caller, stream.time_remaining())
        try:
            tenant = self._edge.identify(call)
            raw = await _request(stream)
            request_type = _REQUEST_TYPES[method]
            try:
                request = request_type.FromString(raw)
                wire.check_text(raw, cast(Descriptor, request_type.DESCRIPTOR), self._max_fields)
            except (DecodeError, wire.WireError) as e:
                raise errors.InvalidArgument(f"malformed {request_type.DESCRIPTOR.full_name}: {e}") from None
            check(tenant, request)
        except StreamError as e:  # no valid message stream (a request over the size limit)
            return status_headers(e.refusal)
        except errors.GatewayError as e:
            if call.tenant is not None:  # identification's refusals are counted by the edge
                self._edge.refused(call, e)
            return status_headers(refusal(e))
        try:
            route = self._edge.upstreams.route(None)
        except errors.Unavailable as e:
            return status_headers(refusal(e))
        reader = self._engine.call(route, path(method), raw, timeout_s=stream.time_remaining())
        try:
            reply = await reader.next()
            while await reader.next() is not None:  # a unary call answers one message
                pass
        finally:
            self._engine.finish(route, reader)
            if method in REPOSITORY_CHANGES:
                self._edge.upstreams.recheck(route.upstream)  # its ready models changed, or may have
        if reader.status != OK or reply is None:
            return reader.trailers  # Triton's own status, as it wrote it
        await stream.write(reply if reply_filter is None else reply_filter(tenant, reply))
        return OK_STATUS

    def _admin(self, method: str) -> _Check:
        return lambda tenant, _request: self._directory.require_admin(tenant, method)

    def _named_model(self, tenant: Tenant, request: Any) -> None:
        self._directory.require_model(tenant, request.name)

    def _named_model_if_any(self, tenant: Tenant, request: Any) -> None:
        if request.name:  # empty asks for every model: the reply is filtered instead
            self._directory.require_model(tenant, request.name)


async def _request(stream: ServerStream) -> bytes:
    """A unary call's one request message (no message at all reads as an empty one)."""
    raw = await stream.read()
    return b"" if raw is None else raw


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
