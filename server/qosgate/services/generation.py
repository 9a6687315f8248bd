"""qosgate.v1.GenerationService over gRPC: convert, call the GenerationPlane, convert back."""

from __future__ import annotations

import contextlib
from collections.abc import AsyncGenerator, AsyncIterator

import grpc

from qosgate.auth import Tenant
from qosgate.dataplane.generation import Finished, GenerationPlane
from qosgate.services.headers import text_headers
from qosgate.v1 import generation_pb2
from qosgate.v1_converters import collect_response, stream_response, to_call


class GenerationServicer:
    """Generate and GenerateStream on top of a GenerationPlane (served through `edge`)."""

    def __init__(self, plane: GenerationPlane) -> None:
        self._plane = plane

    def _items(
        self,
        rpc: str,
        tenant: Tenant,
        request: generation_pb2.GenerateRequest | generation_pb2.GenerateStreamRequest,
        context: grpc.aio.ServicerContext,
    ) -> contextlib.aclosing[AsyncGenerator[str | Finished, None]]:
        """The generation's items; closing them releases the call (the caller left)."""
        return contextlib.aclosing(
            self._plane.generate(
                rpc,
                tenant,
                to_call(request, stream=rpc == "GenerateStream"),
                deadline=self._plane.dataplane.deadline(context.time_remaining()),
                headers=text_headers(context),
            )
        )

    async def Generate(  # noqa: N802 - gRPC method name
        self, tenant: Tenant, request: generation_pb2.GenerateRequest, context: grpc.aio.ServicerContext
    ) -> generation_pb2.GenerateResponse:
        async with self._items("Generate", tenant, request, context) as items:
            return await collect_response(items)

    async def GenerateStream(  # noqa: N802 - gRPC method name
        self,
        tenant: Tenant,
        request: generation_pb2.GenerateStreamRequest,
        context: grpc.aio.ServicerContext,
    ) -> AsyncIterator[generation_pb2.GenerateStreamResponse]:
        async with self._items("GenerateStream", tenant, request, context) as items:
            async for item in items:
                yield stream_response(item)
