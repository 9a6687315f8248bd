"""qosgate.v1's data calls, served by the relay: GenerationService (Generate,
GenerateStream) and EmbeddingService (Embed).

Each is a thin front end: decode the call for the edge (credentials, class, deadline,
session and trace headers), identify its caller before anything of its request is read,
parse the request (INVALID_ARGUMENT when it does not parse), call the plane, write the
replies. The planes reach Triton over the upstream pool's connections, like every other
call; a refusal is answered with the error table's status.
"""

from __future__ import annotations

import contextlib
from collections.abc import Awaitable, Callable, Sequence
from typing import Any

from google.protobuf.message import DecodeError, Message

from qosgate import errors
from qosgate.dataplane.call import Call
from qosgate.dataplane.embedding import EmbeddingPlane
from qosgate.dataplane.generation import GenerationPlane
from qosgate.edge import Edge
from qosgate.relay.messages import OK_STATUS, ServerStream
from qosgate.relay.policy import call_of
from qosgate.transport import http2
from qosgate.transport.messages import StreamError
from qosgate.transport.status import UNIMPLEMENTED, Refuse, refusal, status_headers
from qosgate.v1 import embedding_pb2, generation_pb2
from qosgate.v1_converters import collect_response, embed_response, stream_response, to_call

GENERATION = b"/qosgate.v1.GenerationService/"
EMBEDDING = b"/qosgate.v1.EmbeddingService/"

_Serve = Callable[[Call, Any, ServerStream], Awaitable[None]]


class V1Calls:
    """Serves the data calls of qosgate.v1 (a messages.Handler for both services' path
    prefixes)."""

    def __init__(self, *, edge: Edge, generation: GenerationPlane, embedding: EmbeddingPlane) -> None:
        self._edge = edge
        self._generation = generation
        self._embedding = embedding
        self._methods: dict[bytes, tuple[str, type[Message], _Serve]] = {
            GENERATION + b"Generate": ("Generate", generation_pb2.GenerateRequest, self._generate),
            GENERATION + b"GenerateStream": ("GenerateStream", generation_pb2.GenerateStreamRequest, self._generate_stream),
            EMBEDDING + b"Embed": ("Embed", embedding_pb2.EmbedRequest, self._embed),
        }

    async def __call__(self, stream: ServerStream) -> Sequence[http2.Header]:
        method_path = http2.header(stream.headers, b":path") or b""
        found = self._methods.get(method_path)
        if found is None:
            return status_headers(Refuse(UNIMPLEMENTED, f"unknown method {method_path.decode('latin-1')!r}"))
        rpc, request_type, serve = found
        call = call_of(rpc, stream.headers, stream.caller, stream.time_remaining())
        try:
            self._edge.identify(call)  # before anything of the request is read
            raw = await stream.read()
            try:
                request = request_type.FromString(raw or b"")
            except DecodeError:
                error = errors.InvalidArgument(f"malformed {request_type.DESCRIPTOR.full_name}")
                self._edge.refused(call, error)
                raise error from None
            await serve(call, request, stream)
        except StreamError as e:  # no valid message stream (a request over the size limit)
            return status_headers(e.refusal)
        except Exception as e:  # refused (counted where it was), or a bug: INTERNAL, logged
            return status_headers(refusal(e))
        return OK_STATUS

    async def _generate(self, call: Call, request: generation_pb2.GenerateRequest, stream: ServerStream) -> None:
        call.priority_class = request.priority_class or call.priority_class
        items = self._generation.generate(call, to_call(request, stream=False))
        async with contextlib.aclosing(items):
            response = await collect_response(items)
        await stream.write(response.SerializeToString())

    async def _generate_stream(
        self, call: Call, request: generation_pb2.GenerateStreamRequest, stream: ServerStream
    ) -> None:
        call.priority_class = request.priority_class or call.priority_class
        # Closing the items (the caller left: this task is cancelled) releases the call.
        async with contextlib.aclosing(self._generation.generate(call, to_call(request, stream=True))) as items:
            async for item in items:
                reply = stream_response(item).SerializeToString()
                if not stream.write_now(reply):  # the caller is behind: wait for room
                    await stream.write(reply)

    async def _embed(self, call: Call, request: embedding_pb2.EmbedRequest, stream: ServerStream) -> None:
        call.model = request.model
        call.priority_class = request.priority_class or call.priority_class
        result = await self._embedding.embed(call, list(request.inputs))
        await stream.write(embed_response(result).SerializeToString())
