"""The data plane's ways to Triton on the upstream pool: one ModelStreamInfer per
generation (`PoolEngineStreams`), one ModelInfer per embedding call (`PoolEngineInfer`),
and the one mapping of Triton's gRPC failures to domain errors (`upstream_error`).

Both engines report each upstream attempt to the call's `UpstreamObserver` (which upstream,
its responses, when it ended), so upstream latency and the upstream span are recorded the same way for
every API, and send the observer's headers (W3C `traceparent`) so Triton can continue
the caller's trace.
"""

from __future__ import annotations

from collections.abc import AsyncGenerator, Sequence
from typing import Protocol

import grpc
from tritonclient.grpc import service_pb2

from qosgate import errors
from qosgate.upstream.pool import Upstream, UpstreamPool

# Upstream gRPC codes that are the caller's to fix or retry; anything else is INTERNAL.
_UPSTREAM_CODES = {
    grpc.StatusCode.INVALID_ARGUMENT: errors.InvalidArgument,
    # The model cannot serve this API (ModelInfer on a decoupled LLM, say): the caller's choice.
    grpc.StatusCode.UNIMPLEMENTED: errors.InvalidArgument,
    grpc.StatusCode.NOT_FOUND: errors.NotFound,
    grpc.StatusCode.DEADLINE_EXCEEDED: errors.DeadlineExceeded,
    grpc.StatusCode.CANCELLED: errors.Cancelled,
    grpc.StatusCode.UNAVAILABLE: errors.Unavailable,
}


class UpstreamObserver(Protocol):
    """What a call lets its engine report: each attempt at an upstream, and the headers
    (trace context) every attempt carries to Triton."""

    def upstream_started(self, upstream: str) -> None:
        """An attempt at `upstream` begins (a failover starts a second one)."""

    def responded(self) -> None:
        """A response came from the upstream (every one; the first is what counts)."""

    def upstream_finished(self) -> None:
        """The current attempt ended (last response, failure or cancel)."""

    def upstream_headers(self) -> Sequence[tuple[str, str]]:
        """Metadata to send with the call to Triton."""


class PoolEngineStreams:
    """The generation plane's engine: one ModelStreamInfer call per generation."""

    def __init__(self, pool: UpstreamPool) -> None:
        self._pool = pool

    async def open(
        self,
        request: service_pb2.ModelInferRequest,
        timeout_s: float | None,
        observer: UpstreamObserver,
        *,
        prompt: str,
        session: str | None = None,
    ) -> AsyncGenerator[service_pb2.ModelInferResponse, None]:
        """The request's responses; if its upstream fails UNAVAILABLE before the first one,
        the request goes once more to another upstream (pool.failover), never after.
        `prompt` and `session` are what the model's routing may key the upstream on.

        Closing the iterator early (the caller went away) cancels the upstream call, so
        Triton cancels the request in the engine."""
        model, payload = request.model_name, request.SerializeToString()
        key = self._pool.key(model, prompt=prompt, session=session)
        upstream = self._pool.pick(model, key=key)
        retried = False
        while True:
            responded = False
            with upstream.lease():
                observer.upstream_started(upstream.name)
                call = upstream.stream()(timeout=timeout_s, metadata=observer.upstream_headers())
                try:
                    await call.write(payload)
                    async for raw in call:
                        responded = True
                        message = service_pb2.ModelStreamInferResponse.FromString(raw)
                        if message.error_message:
                            # Triton reports a request's own failure in the stream, without a
                            # code: the model refused this request (bad sampling, prompt too long).
                            raise errors.InvalidArgument(f"model {model!r}: {message.error_message}")
                        observer.responded()
                        yield message.infer_response
                    return
                except grpc.aio.AioRpcError as e:
                    error = e
                finally:
                    # Early close (the caller cancelled, or the final response was read):
                    # cancelling the call makes Triton cancel the request in the engine.
                    call.cancel()
                    observer.upstream_finished()
            other = None if retried or responded else self._pool.failover(model, upstream, error.code(), key=key)
            if other is None:
                raise upstream_error(self._pool, upstream, error) from error
            upstream, retried = other, True


class PoolEngineInfer:
    """The embedding plane's engine: one ModelInfer per call."""

    def __init__(self, pool: UpstreamPool) -> None:
        self._pool = pool

    async def infer(
        self, request: service_pb2.ModelInferRequest, timeout_s: float | None, observer: UpstreamObserver
    ) -> service_pb2.ModelInferResponse:
        model, payload = request.model_name, request.SerializeToString()
        upstream = self._pool.pick(model)
        retried = False
        while True:
            with upstream.lease():
                observer.upstream_started(upstream.name)
                try:
                    raw = await upstream.unary("ModelInfer")(
                        payload, timeout=timeout_s, metadata=observer.upstream_headers()
                    )
                    observer.responded()
                    return service_pb2.ModelInferResponse.FromString(raw)
                except grpc.aio.AioRpcError as e:
                    error = e
                finally:
                    observer.upstream_finished()
            # Failover once at most: the retry's own failure is the answer.
            other = None if retried else self._pool.failover(model, upstream, error.code(), key=None)
            if other is None:
                raise upstream_error(self._pool, upstream, error) from error
            upstream, retried = other, True


def upstream_error(pool: UpstreamPool, upstream: Upstream, error: grpc.aio.AioRpcError) -> errors.GatewayError:
    """The domain error for a failed call to Triton; an UNAVAILABLE upstream is rechecked."""
    if error.code() is grpc.StatusCode.UNAVAILABLE:
        pool.recheck(upstream)
    kind = _UPSTREAM_CODES.get(error.code())
    if kind is None:
        return errors.Internal(f"Triton failed: {error.code().name}: {error.details()}")
    return kind(f"Triton: {error.details()}")
