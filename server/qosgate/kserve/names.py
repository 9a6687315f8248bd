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
# The request parameter our vLLM backend reads as the engine priority (smaller runs first):
# Triton's own `priority` does not reach Python models in Triton 2.51. The gateway stamps
# it beside `priority`, with the class's level, on KServe and generation dispatches.
ENGINE_PRIORITY_PARAMETER = "vllm_priority"


def path(method: str) -> bytes:
    """The HTTP/2 `:path` of a KServe method."""
    return f"/{SERVICE}/{method}".encode()
