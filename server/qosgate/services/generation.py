"""qosgate.v1.GenerationService over gRPC: convert, call the GenerationPlane, convert back.

Also the plane's way to Triton (`PoolEngineStreams`): one ModelStreamInfer call per
generation on an upstream of the pool, cancelled when the generation is closed early.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncGenerator, AsyncIterator, Callable

import grpc
from google.protobuf import duration_pb2
from tritonclient.grpc import service_pb2

from qosgate import errors
from qosgate.adapters.domain import ChatMessage, FinishReason, Role
from qosgate.auth import Tenant
from qosgate.generation import CallLabels, Finished, GenerationCall, GenerationPlane, RouteHint
from qosgate.metrics import GatewayMetrics
from qosgate.services import status
from qosgate.services.headers import text_headers
from qosgate.upstream import Upstream, UpstreamPool
from qosgate.v1 import common_pb2, generation_pb2

_ROLES = {
    generation_pb2.ROLE_SYSTEM: Role.SYSTEM,
    generation_pb2.ROLE_USER: Role.USER,
    generation_pb2.ROLE_ASSISTANT: Role.ASSISTANT,
}
_FINISH = {
    FinishReason.STOP: generation_pb2.FINISH_REASON_STOP,
    FinishReason.LENGTH: generation_pb2.FINISH_REASON_LENGTH,
    FinishReason.CANCELLED: generation_pb2.FINISH_REASON_CANCELLED,
}
# Upstream gRPC codes that are the caller's to fix or retry; anything else is INTERNAL.
_UPSTREAM_CODES = {
    grpc.StatusCode.INVALID_ARGUMENT: errors.InvalidArgument,
    grpc.StatusCode.NOT_FOUND: errors.NotFound,
    grpc.StatusCode.DEADLINE_EXCEEDED: errors.DeadlineExceeded,
    grpc.StatusCode.CANCELLED: errors.Cancelled,
    grpc.StatusCode.UNAVAILABLE: errors.Unavailable,
}


def to_call(
    request: generation_pb2.GenerateRequest | generation_pb2.GenerateStreamRequest, *, stream: bool
) -> GenerationCall:
    """The domain call of a GenerateRequest or GenerateStreamRequest."""
    sampling = request.sampling
    messages = None
    if request.WhichOneof("input") == "chat":
        messages = tuple(_message(i, m) for i, m in enumerate(request.chat.messages))
    return GenerationCall(
        model=request.model,
        prompt=request.prompt if request.WhichOneof("input") == "prompt" else None,
        messages=messages,
        max_tokens=sampling.max_tokens if sampling.HasField("max_tokens") else None,
        temperature=sampling.temperature if sampling.HasField("temperature") else None,
        top_p=sampling.top_p if sampling.HasField("top_p") else None,
        top_k=sampling.top_k if sampling.HasField("top_k") else None,
        seed=sampling.seed if sampling.HasField("seed") else None,
        stop=tuple(sampling.stop),
        priority_class=request.priority_class or None,
        stream=stream,
    )


def _message(index: int, message: generation_pb2.ChatMessage) -> ChatMessage:
    role = _ROLES.get(message.role)
    if role is None:
        raise errors.InvalidArgument(f"chat.messages[{index}].role must be set")
    return ChatMessage(role, message.content)


def duration(seconds: float) -> duration_pb2.Duration:
    duration = duration_pb2.Duration()
    duration.FromNanoseconds(max(0, round(seconds * 1e9)))
    return duration


def _usage(finished: Finished) -> common_pb2.Usage:
    return common_pb2.Usage(
        prompt_tokens=finished.usage.prompt_tokens, completion_tokens=finished.usage.completion_tokens
    )


def _timing(finished: Finished) -> common_pb2.Timing:
    timing = finished.timing
    return common_pb2.Timing(
        queue=duration(timing.queue_s),
        time_to_first_token=duration(timing.first_token_s),
        total=duration(timing.total_s),
    )


async def collect_response(items: AsyncIterator[str | Finished]) -> generation_pb2.GenerateResponse:
    """The unary response of a generation: its deltas joined, with the final outcome."""
    texts: list[str] = []
    async for item in items:
        if isinstance(item, Finished):
            return generation_pb2.GenerateResponse(
                text="".join(texts),
                finish_reason=_FINISH[item.finish_reason],
                usage=_usage(item),
                timing=_timing(item),
            )
        texts.append(item)
    raise errors.Internal("generation ended without a result")


def upstream_error(pool: UpstreamPool, upstream: Upstream, error: grpc.aio.AioRpcError) -> errors.GatewayError:
    """The domain error for a failed call to Triton; an UNAVAILABLE upstream is rechecked."""
    if error.code() is grpc.StatusCode.UNAVAILABLE:
        pool.recheck(upstream)
    kind = _UPSTREAM_CODES.get(error.code())
    if kind is None:
        return errors.Internal(f"Triton failed: {error.code().name}: {error.details()}")
    return kind(f"Triton: {error.details()}")


def record_generation(
    metrics: GatewayMetrics, rpc: str, model: str, labels: CallLabels, error: BaseException | None
) -> None:
    """Count a finished generation call by its outcome's status code (the one table's),
    for every front end alike (`rpc` names the API and method)."""
    code = "OK"
    if isinstance(error, (asyncio.CancelledError, GeneratorExit)):
        code = grpc.StatusCode.CANCELLED.name
    elif error is not None:
        row = status.row_of(error)
        code = row.code.name
        if isinstance(error, errors.GatewayError):
            metrics.rejected(row.reason, labels.tenant, labels.klass)
    if labels.queue_wait_s is not None:
        metrics.queue_wait(labels.klass, labels.tenant, labels.queue_wait_s)
    metrics.request_done(rpc, model, labels.tenant, labels.klass, code)


class GenerationServicer:
    """Generate and GenerateStream on top of a GenerationPlane (served through `edge`)."""

    def __init__(
        self, plane: GenerationPlane, *, clock_now: Callable[[], float], metrics: GatewayMetrics
    ) -> None:
        self._plane = plane
        self._now = clock_now
        self._metrics = metrics

    def _record(self, rpc: str, model: str, labels: CallLabels, error: BaseException | None) -> None:
        record_generation(self._metrics, rpc, model, labels, error)

    def _deadline(self, context: grpc.aio.ServicerContext) -> float | None:
        remaining = context.time_remaining()
        return None if remaining is None else self._now() + remaining

    async def Generate(  # noqa: N802 - gRPC method name
        self, tenant: Tenant, request: generation_pb2.GenerateRequest, context: grpc.aio.ServicerContext
    ) -> generation_pb2.GenerateResponse:
        labels = CallLabels(tenant=tenant.name)
        try:
            call = to_call(request, stream=False)
            async with contextlib.aclosing(
                self._plane.generate(
                    tenant, call, deadline=self._deadline(context), labels=labels, headers=text_headers(context)
                )
            ) as items:
                response = await collect_response(items)
        except BaseException as e:  # recorded by cause; the edge answers it
            self._record("Generate", request.model, labels, e)
            raise
        self._record("Generate", request.model, labels, None)
        return response

    async def GenerateStream(  # noqa: N802 - gRPC method name
        self,
        tenant: Tenant,
        request: generation_pb2.GenerateStreamRequest,
        context: grpc.aio.ServicerContext,
    ) -> AsyncIterator[generation_pb2.GenerateStreamResponse]:
        labels = CallLabels(tenant=tenant.name)
        try:
            call = to_call(request, stream=True)
            async with contextlib.aclosing(
                self._plane.generate(
                    tenant, call, deadline=self._deadline(context), labels=labels, headers=text_headers(context)
                )
            ) as items:
                async for item in items:
                    if isinstance(item, Finished):
                        yield generation_pb2.GenerateStreamResponse(
                            finish_reason=_FINISH[item.finish_reason], usage=_usage(item), timing=_timing(item)
                        )
                    else:
                        yield generation_pb2.GenerateStreamResponse(text=item)
        except BaseException as e:  # GeneratorExit or CancelledError: the caller went away
            self._record("GenerateStream", request.model, labels, e)
            raise
        self._record("GenerateStream", request.model, labels, None)


class PoolEngineStreams:
    """`EngineStreams` on the upstream pool: one ModelStreamInfer call per generation."""

    def __init__(self, pool: UpstreamPool) -> None:
        self._pool = pool

    async def open(
        self, request: service_pb2.ModelInferRequest, timeout_s: float | None, route: RouteHint
    ) -> AsyncGenerator[service_pb2.ModelInferResponse, None]:
        """The request's responses; if its upstream fails UNAVAILABLE before the first one,
        the request goes once more to another upstream (pool.failover), never after."""
        model, payload = request.model_name, request.SerializeToString()
        key = self._pool.key(model, prompt=route.prompt, session=route.session)
        upstream = self._pool.pick(model, key=key)
        retried = False
        while True:
            responded = False
            with upstream.lease():
                call = upstream.stream()(timeout=timeout_s)
                try:
                    await call.write(payload)
                    async for raw in call:
                        responded = True
                        message = service_pb2.ModelStreamInferResponse.FromString(raw)
                        if message.error_message:
                            # Triton reports a request's own failure in the stream, without a
                            # code: the model refused this request (bad sampling, prompt too long).
                            raise errors.InvalidArgument(f"model {model!r}: {message.error_message}")
                        yield message.infer_response
                    return
                except grpc.aio.AioRpcError as e:
                    error = e
                finally:
                    # Early close (the caller cancelled, or the final response was read):
                    # cancelling the call makes Triton cancel the request in the engine.
                    call.cancel()
            other = None if retried or responded else self._pool.failover(model, upstream, error.code(), key=key)
            if other is None:
                raise upstream_error(self._pool, upstream, error) from error
            upstream, retried = other, True
