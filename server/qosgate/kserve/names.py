"""The names of KServe v2's service and methods, and of the request headers every API of
the gateway reads beside the credentials (`auth`) and the trace context (`dataplane.tracing`)."""

from __future__ import annotations

from tritonclient.grpc import service_pb2

SERVICE = "inference.GRPCInferenceService"
METHODS = tuple(m.name for m in service_pb2.DESCRIPTOR.services_by_name["GRPCInferenceService"].methods)
INFER = "ModelInfer"
STREAM_INFER = "ModelStreamInfer"

# The priority class a caller asks for (KServe, qosgate.v1 metadata, the OpenAI API).
PRIORITY_HEADER = "x-priority"
# Triton closes a stream at its first error when the caller sends this header; the
# gateway then does the same for its own refusals.
GRPC_ERROR_HEADER = "triton_grpc_error"


def path(method: str) -> bytes:
    """The HTTP/2 `:path` of a KServe method."""
    return f"/{SERVICE}/{method}".encode()
