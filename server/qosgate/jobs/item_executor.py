"""The batch runner's ItemExecutor: a stored item request (a qosgate.v1 message) run
through the same edge and planes as the GenerationService and EmbeddingService calls, as
the job's tenant, at the batch class, within its job's completion window; counted in
metrics as `batch.Generate` / `batch.Embed`."""

from __future__ import annotations

import contextlib

from qosgate.auth import Tenant
from qosgate.dataplane.call import Call
from qosgate.dataplane.embedding import EmbeddingPlane
from qosgate.dataplane.generation import GenerationPlane
from qosgate.jobs.model import ItemKind
from qosgate.v1 import embedding_pb2, generation_pb2
from qosgate.v1_converters import collect_response, embed_response, to_call


class PlaneItemExecutor:
    """Runs generation items unary (whole text) and embedding items as one call each."""

    def __init__(self, generation: GenerationPlane, embedding: EmbeddingPlane) -> None:
        self._generation = generation
        self._embedding = embedding

    async def execute(self, tenant: Tenant, kind: ItemKind, payload: bytes, klass: str, timeout_s: float) -> bytes:
        if kind is ItemKind.GENERATE:
            request = generation_pb2.GenerateRequest.FromString(payload)
            call = Call("batch.Generate", priority_class=klass, timeout_s=timeout_s, tenant=tenant)
            async with contextlib.aclosing(self._generation.generate(call, to_call(request, stream=False))) as items:
                response = await collect_response(items)
            return response.SerializeToString()
        embed = embedding_pb2.EmbedRequest.FromString(payload)
        call = Call("batch.Embed", model=embed.model, priority_class=klass, timeout_s=timeout_s, tenant=tenant)
        result = await self._embedding.embed(call, list(embed.inputs))
        return embed_response(result).SerializeToString()
