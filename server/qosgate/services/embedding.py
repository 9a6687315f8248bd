"""qosgate.v1.EmbeddingService over gRPC: convert, call the EmbeddingPlane, convert back."""

from __future__ import annotations

import grpc

from qosgate.auth import Tenant
from qosgate.dataplane.embedding import EmbeddingPlane
from qosgate.services.headers import text_headers
from qosgate.v1 import embedding_pb2
from qosgate.v1_converters import embed_response


class EmbeddingServicer:
    """Embed on top of an EmbeddingPlane (served through `edge`)."""

    def __init__(self, plane: EmbeddingPlane) -> None:
        self._plane = plane

    async def Embed(  # noqa: N802 - gRPC method name
        self, tenant: Tenant, request: embedding_pb2.EmbedRequest, context: grpc.aio.ServicerContext
    ) -> embedding_pb2.EmbedResponse:
        result = await self._plane.embed(
            "Embed",
            tenant,
            request.model,
            list(request.inputs),
            priority_class=request.priority_class or None,
            deadline=self._plane.dataplane.deadline(context.time_remaining()),
            headers=text_headers(context),
        )
        return embed_response(result)
