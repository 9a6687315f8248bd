"""The gateway's own calls to Triton, message by message over the upstream pool's
connections (the relay's KServe unary calls go as frames instead): a generation's
ModelStreamInfer, an embedding's ModelInfer, a KServe metadata RPC; and the one mapping of
Triton's statuses to domain errors (`upstream_error`).

Each call goes to its `Route`'s upstream and fails over as the route allows (a
`connections.ClientStream` does both), and is reported to the route when it ends.
"""

from __future__ import annotations

from collections.abc import AsyncGenerator, Sequence

from tritonclient.grpc import service_pb2

from qosgate import errors
from qosgate.kserve.names import INFER, STREAM_INFER, path
from qosgate.transport import http2
from qosgate.transport.status import (
    CANCELLED,
    DEADLINE_EXCEEDED,
    INVALID_ARGUMENT,
    NOT_FOUND,
    OK,
    RESOURCE_EXHAUSTED,
    UNAVAILABLE,
    UNIMPLEMENTED,
    code_name,
    decode_message,
)
from qosgate.upstream.connections import ClientReader, ClientStream
from qosgate.upstream.pool import Route, UpstreamPool

_INFER_PATH = path(INFER)
# How Triton words a request for a model it does not have (NOT_FOUND in a unary call's status).
_UNKNOWN_MODEL = "Request for unknown model"
_STREAM_INFER_PATH = path(STREAM_INFER)
# Triton's codes that are the caller's to fix or retry; anything else is INTERNAL.
_UPSTREAM_CODES: dict[int, type[errors.GatewayError]] = {
    INVALID_ARGUMENT: errors.InvalidArgument,
    # The model cannot serve this RPC: the caller's choice (ModelInfer on a decoupled model
    # says so in Engine.infer).
    UNIMPLEMENTED: errors.InvalidArgument,
    NOT_FOUND: errors.NotFound,
    DEADLINE_EXCEEDED: errors.DeadlineExceeded,
    CANCELLED: errors.Cancelled,
    UNAVAILABLE: errors.Unavailable,
    # Triton's queue for the model is full: retry later, as for the gateway's own shedding.
    RESOURCE_EXHAUSTED: errors.Unavailable,
}


class Engine:
    """Calls to Triton for the planes (generation, embedding) and the relay's KServe RPCs;
    `max_response_bytes` bounds each response message taken."""

    def __init__(self, pool: UpstreamPool, *, max_response_bytes: int) -> None:
        self._pool = pool
        self._limit = max_response_bytes

    def call(
        self, route: Route, method_path: bytes, request: bytes, *, headers: Sequence[http2.Header] = (), timeout_s: float | None = None
    ) -> ClientReader:
        """Start one call of `method_path` carrying `request` on the route's upstream; its
        responses and end come out of the reader. End it with `finish`."""
        reader = ClientReader()
        reader.stream = ClientStream(
            route.connections,
            method_path,
            (request,),
            reader,
            limit=self._limit,
            extra=headers,
            timeout_s=timeout_s,
            failover=route.failover if route.can_fail_over else None,
        )
        return reader

    def finish(self, route: Route, reader: ClientReader) -> None:
        """The call is over for its caller: cancelled upstream if it still runs, reported
        to its route, and its upstream checked now if it answered UNAVAILABLE."""
        reader.cancel()
        if reader.status == UNAVAILABLE:
            self._pool.recheck(route.upstream)
        route.done()

    async def stream(
        self, route: Route, request: bytes, *, headers: Sequence[http2.Header] = (), timeout_s: float | None = None
    ) -> AsyncGenerator[service_pb2.ModelInferResponse, None]:
        """One generation request (a serialized ModelInferRequest) as a ModelStreamInfer
        of its own; its responses. Closing the iterator early (the caller went away)
        cancels it upstream, so Triton cancels the request in the engine."""
        reader = self.call(route, _STREAM_INFER_PATH, request, headers=headers, timeout_s=timeout_s)
        try:
            while (raw := await reader.next()) is not None:
                message = service_pb2.ModelStreamInferResponse.FromString(raw)
                if message.error_message:
                    # Triton reports a request's own failure in the stream, without a
                    # code: the model refused this request (bad sampling, prompt too long).
                    # (Its response names no model when Triton refused it before running it.)
                    model = message.infer_response.model_name or route.model
                    if _UNKNOWN_MODEL in message.error_message:  # as Triton's status for a unary call says
                        raise errors.NotFound(f"model {model!r}: {message.error_message}")
                    raise errors.InvalidArgument(f"model {model!r}: {message.error_message}")
                route.responded()
                yield message.infer_response
            if reader.status != OK:
                raise upstream_error(reader)
        finally:
            self.finish(route, reader)

    async def infer(
        self, route: Route, request: bytes, *, headers: Sequence[http2.Header] = (), timeout_s: float | None = None
    ) -> service_pb2.ModelInferResponse:
        """One ModelInfer (a serialized ModelInferRequest); its response."""
        reader = self.call(route, _INFER_PATH, request, headers=headers, timeout_s=timeout_s)
        try:
            raw = await reader.next()
            while await reader.next() is not None:  # a unary call answers one message
                pass
            if reader.status == UNIMPLEMENTED:
                # Triton serves a decoupled model (an LLM backend) on ModelStreamInfer only.
                raise errors.InvalidArgument(
                    f"model {route.model!r} streams its responses (a decoupled model, such as an LLM): "
                    f"it cannot answer this call with one response ({upstream_message(reader)})"
                )
            if reader.status != OK:
                raise upstream_error(reader)
            if raw is None:
                raise errors.Internal("Triton answered a ModelInfer without a response")
            route.responded()
            return service_pb2.ModelInferResponse.FromString(raw)
        finally:
            self.finish(route, reader)


def upstream_message(reader: ClientReader) -> str:
    """Triton's grpc-message of a failed call, decoded."""
    return decode_message(http2.header(reader.trailers, b"grpc-message") or b"")


def upstream_error(reader: ClientReader) -> errors.GatewayError:
    """The domain error for a call that Triton (or the way to it) failed."""
    status = UNAVAILABLE if reader.status is None else reader.status
    message = upstream_message(reader)
    kind = _UPSTREAM_CODES.get(status)
    if kind is None:
        return errors.Internal(f"Triton failed: {code_name(status)}: {message}")
    return kind(f"Triton: {message}")
