"""qosgate.v1.EmbeddingService over gRPC, and the embedding plane's way to Triton."""

from __future__ import annotations

from collections.abc import Callable

import grpc
from tritonclient.grpc import service_pb2

from qosgate.auth import Tenant
from qosgate.embedding import EmbeddingPlane, Embeddings
from qosgate.services.generation import duration, upstream_error
from qosgate.upstream import UpstreamPool
from qosgate.v1 import common_pb2, embedding_pb2


def embed_response(result: Embeddings) -> embedding_pb2.EmbedResponse:
    """The wire form of an embedding result."""
    return embedding_pb2.EmbedResponse(
        embeddings=[embedding_pb2.Embedding(values=v) for v in result.vectors],
        timing=common_pb2.Timing(
            queue=duration(result.queue_s),
            time_to_first_token=duration(result.total_s),
            total=duration(result.total_s),
        ),
    )


class EmbeddingServicer:
    """Embed on top of an EmbeddingPlane (served through `edge`)."""

    def __init__(self, plane: EmbeddingPlane, *, clock_now: Callable[[], float]) -> None:
        self._plane = plane
        self._now = clock_now

    async def Embed(  # noqa: N802 - gRPC method name
        self, tenant: Tenant, request: embedding_pb2.EmbedRequest, context: grpc.aio.ServicerContext
    ) -> embedding_pb2.EmbedResponse:
        remaining = context.time_remaining()
        result = await self._plane.embed(
            tenant,
            request.model,
            list(request.inputs),
            priority_class=request.priority_class or None,
            deadline=None if remaining is None else self._now() + remaining,
        )
        return embed_response(result)


class PoolEngineInfer:
    """`EngineInfer` on the upstream pool."""

    def __init__(self, pool: UpstreamPool) -> None:
        self._pool = pool

    async def infer(
        self, request: service_pb2.ModelInferRequest, timeout_s: float | None
    ) -> service_pb2.ModelInferResponse:
        model, payload = request.model_name, request.SerializeToString()
        upstream = self._pool.pick(model)
        retried = False
        while True:
            with upstream.lease():
                try:
                    raw = await upstream.unary("ModelInfer")(payload, timeout=timeout_s)
                    return service_pb2.ModelInferResponse.FromString(raw)
                except grpc.aio.AioRpcError as e:
                    error = e
            # Failover once at most: the retry's own failure is the answer.
            other = None if retried else self._pool.failover(model, upstream, error.code(), key=None)
            if other is None:
                raise upstream_error(self._pool, upstream, error) from error
            upstream, retried = other, True
