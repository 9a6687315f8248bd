"""How the gateway's gRPC server serves its RPCs (the admin and batch services: what is
not on the data path): identify the caller (the one edge), parse, call, answer errors.

Methods are registered bytes in: the request is parsed here, AFTER the caller is
identified. So a caller without a valid key gets UNAUTHENTICATED whatever bytes it sends,
and bytes that do not parse are INVALID_ARGUMENT, where grpc's own deserializer would
answer UNKNOWN before authentication and log a traceback per call (a log flood anyone
could cause). Whatever a servicer raises goes through the one error table
(`error_table`, as `services.status` hands it to grpcio): refusals with their code and
message, anything else INTERNAL with an incident number.

A servicer method takes `(tenant, request, context)`: the request parsed (or, for a
client stream, an async iterator of parsed requests; or the bytes as they came when the
method has no parser), and returns or yields the response.
"""

from __future__ import annotations

import traceback
from collections.abc import AsyncIterator, Callable, Mapping
from dataclasses import dataclass
from typing import Any

import grpc
from google.protobuf import message_factory
from google.protobuf.descriptor import ServiceDescriptor
from google.protobuf.message import DecodeError, Message

from qosgate import errors
from qosgate.auth import ConnectionCredentials, Tenant
from qosgate.dataplane.call import Call
from qosgate.edge import Edge
from qosgate.services import status
from qosgate.tls import certificate_from_metadata

Parse = Callable[[bytes], Any]


@dataclass(frozen=True, slots=True)
class Method:
    """One RPC: its implementation and shape; no `parse`/`serialize` means bytes as they are."""

    call: Callable[..., Any]
    client_streaming: bool = False
    server_streaming: bool = False
    parse: Parse | None = None
    serialize: Callable[[Any], bytes] | None = None
    name: str = ""  # the RPC's method name (the `rpc` label of a refusal)


def parser(message_type: type[Message]) -> Parse:
    """Parses one request of `message_type`; bytes that do not parse are INVALID_ARGUMENT."""
    name = message_type.DESCRIPTOR.full_name

    def parse(raw: bytes) -> Message:
        try:
            return message_type.FromString(raw)
        except DecodeError:
            raise errors.InvalidArgument(f"malformed {name}") from None

    return parse


def servicer_methods(service: ServiceDescriptor, servicer: object) -> dict[str, Method]:
    """Every method of a qosgate.v1 `service`, implemented by `servicer`'s method of the
    same name (refusing to start if one is missing rather than answering UNIMPLEMENTED)."""
    methods = {}
    for method in service.methods:
        call = getattr(servicer, method.name, None)
        if call is None:
            raise RuntimeError(f"{type(servicer).__name__} does not implement {method.full_name}")
        if method.client_streaming and method.server_streaming:  # the data path's shape: the relay's
            raise RuntimeError(f"{method.full_name}: bidirectional streams are not served here")
        methods[method.name] = Method(
            call=call,
            client_streaming=method.client_streaming,
            server_streaming=method.server_streaming,
            parse=parser(message_factory.GetMessageClass(method.input_type)),
            serialize=message_factory.GetMessageClass(method.output_type).SerializeToString,
            name=method.name,
        )
    return methods


class Handlers:
    """Turns Methods into gRPC handlers that identify the caller first (see the module)."""

    def __init__(self, edge: Edge) -> None:
        self._edge = edge

    def handler(self, service: str, methods: Mapping[str, Method]) -> grpc.GenericRpcHandler:
        """A generic handler serving `methods` of the fully qualified `service`."""
        handlers = {name: self._rpc_handler(method) for name, method in methods.items()}
        return grpc.method_handlers_generic_handler(service, handlers)

    def _rpc_handler(self, method: Method) -> grpc.RpcMethodHandler:
        serializer = method.serialize
        if method.client_streaming:
            return grpc.stream_unary_rpc_method_handler(
                self._stream_unary(method), response_serializer=serializer
            )
        if method.server_streaming:
            return grpc.unary_stream_rpc_method_handler(
                self._unary_stream(method), response_serializer=serializer
            )
        return grpc.unary_unary_rpc_method_handler(
            self._unary_unary(method), response_serializer=serializer
        )

    def _call(self, method: Method, context: grpc.aio.ServicerContext) -> Call:
        """The call as the edge takes it: its metadata as sent, and the caller's verified
        certificate, which the relay (the only way to this server: it terminated TLS)
        passed on in headers (qosgate.tls)."""
        metadata = context.invocation_metadata() or ()
        headers = [(key.encode("latin-1"), value.encode("latin-1")) for key, value in metadata if isinstance(value, str)]
        return Call(method.name, headers, ConnectionCredentials(certificate_from_metadata(metadata)))

    def _identify(self, method: Method, context: grpc.aio.ServicerContext) -> tuple[Call, Tenant]:
        call = self._call(method, context)
        return call, self._edge.identify(call)

    def _parse(self, method: Method, call: Call, raw: bytes) -> Any:
        if method.parse is None:
            return raw
        try:
            return method.parse(raw)
        except errors.GatewayError as e:
            self._edge.refused(call, e)
            raise

    def _unary_unary(self, method: Method) -> Callable[..., Any]:
        async def handle(raw: bytes, context: grpc.aio.ServicerContext) -> Any:
            try:
                call, tenant = self._identify(method, context)
                return await method.call(tenant, self._parse(method, call, raw), context)
            except Exception as e:
                raw = b""  # see `_answer`: this frame outlives the call
                await _answer(context, e)

        return handle

    def _unary_stream(self, method: Method) -> Callable[..., Any]:
        async def handle(raw: bytes, context: grpc.aio.ServicerContext) -> AsyncIterator[Any]:
            try:
                call, tenant = self._identify(method, context)
                async for reply in method.call(tenant, self._parse(method, call, raw), context):
                    yield reply
            except Exception as e:
                raw = b""  # see `_answer`: this frame outlives the call
                await _answer(context, e)

        return handle

    def _stream_unary(self, method: Method) -> Callable[..., Any]:
        async def handle(requests: AsyncIterator[bytes], context: grpc.aio.ServicerContext) -> Any:
            try:
                call, tenant = self._identify(method, context)
                return await method.call(tenant, self._parsed(method, call, requests), context)
            except Exception as e:
                await _answer(context, e)

        return handle

    def _parsed(self, method: Method, call: Call, requests: AsyncIterator[bytes]) -> AsyncIterator[Any]:
        if method.parse is None:
            return requests

        async def parsed() -> AsyncIterator[Any]:
            async for raw in requests:
                yield self._parse(method, call, raw)

        return parsed()


async def _answer(context: grpc.aio.ServicerContext, error: Exception) -> None:
    # grpc keeps the abort's exception on the call's state, and the frames in its
    # traceback reach that state through their `context`: a reference cycle that would
    # hold the request (a local of those frames) until the next full collection, hundreds
    # of MB after big requests. The finished frames let go of their locals here (their
    # lines stay for the log); the running handler drops its request itself.
    _clear_frames(error)
    if isinstance(error, grpc.aio.AbortError):
        raise error  # the servicer already answered (e.g. Triton's own error passed through)
    if context.done():
        # The call is over: the servicer's own abort started (grpc counts it) but could
        # not send its status because the caller had gone or its deadline had passed, so
        # grpc's send error came here instead of the abort's. There is no one to answer,
        # and a second abort would fail ("Abort already called!"); returning lets grpc
        # end the call as the first abort left it.
        return
    await status.abort(context, error)


def _clear_frames(error: BaseException) -> None:
    """Clear the locals of the finished frames `error` and the errors it chains passed."""
    seen: set[int] = set()
    current: BaseException | None = error
    while current is not None and id(current) not in seen:
        seen.add(id(current))
        traceback.clear_frames(current.__traceback__)
        current = current.__cause__ or current.__context__
