"""The OpenAI-compatible HTTP server (aiohttp), on the gateway's own event loop.

Each route parses the wire, calls the plane the gRPC servicer of the same API calls
(GenerationPlane.generate, EmbeddingPlane.embed, the batch job store through
OpenAIBatches) and writes OpenAI's JSON. Every failure, from any route, goes through the
one error table (`errors.http_error`).

With the gateway's `tls:` the listener speaks HTTPS with the gRPC listener's certificate,
and with `tls.client_ca` it requires a client certificate, which identifies a tenant as it
does over gRPC (`tenants[].client_certs`).

A client that disconnects cancels its handler (aiohttp's handler_cancellation), which
closes the generation and so cancels the request in the engine, as a cancelled gRPC
stream does; a streaming response also notices at its next write.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import math
import ssl
import uuid
import zlib
from collections.abc import AsyncGenerator, Awaitable, Callable
from typing import Any, TypeVar

from http import HTTPStatus

from aiohttp import BodyPartReader, HttpVersion11, web
from aiohttp.http_exceptions import BadHttpMessage
from aiohttp.web_protocol import RequestHandler, RequestPayloadError
from aiohttp.web_request import BaseRequest

from qosgate import errors
from qosgate.auth import ConnectionCredentials, Tenant
from qosgate.config import OpenAIConfig
from qosgate.dataplane.call import Call
from qosgate.dataplane.embedding import EmbeddingPlane
from qosgate.dataplane.generation import Finished, GenerationPlane
from qosgate.edge import Edge
from qosgate.kserve.names import PRIORITY_HEADER
from qosgate.openai_api import wire
from qosgate.openai_api.batches import BatchCreateRequest, OpenAIBatches
from qosgate.openai_api.errors import http_error
from qosgate.tls import peer_certificate
from qosgate.upstream import UpstreamPool
from qosgate.v1_converters import to_call

log = logging.getLogger(__name__)

# OpenAI's service tiers that mean "no preference" unless the config maps them.
_DEFAULT_TIERS = ("auto", "default")
DEFAULT_PAGE_SIZE = 20
MAX_PAGE_SIZE = 100
# How long a stop waits for requests in flight (the gRPC server's default grace too).
SHUTDOWN_GRACE_S = 5.0

T = TypeVar("T")
Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]
_CALL = web.RequestKey("call", Call)  # each request's call, as the edge takes it
# The `rpc` label of each route's calls.
_RPCS = {
    "/v1/chat/completions": "openai.ChatCompletions",
    "/v1/completions": "openai.Completions",
    "/v1/embeddings": "openai.Embeddings",
}
# Headers a caller gives its request's time in, seconds: `timeout`, and what the official
# SDKs send (the Node one: its client's timeout).
_TIMEOUT_HEADERS = ("timeout", "x-stainless-timeout")
# An upload's body beyond its file: the boundaries, part headers and the purpose field.
_MULTIPART_OVERHEAD = 64 * 1024
# A longer timeout is taken as this one: gRPC's longest (`grpc-timeout` 99999999H), which
# Triton's microsecond timeout parameter still holds.
_LONGEST_TIMEOUT_S = 99_999_999 * 3600.0


class OpenAIServer:
    """The HTTP routes of the OpenAI API over the gateway's planes."""

    def __init__(
        self,
        *,
        config: OpenAIConfig,
        edge: Edge,
        generation: GenerationPlane,
        embedding: EmbeddingPlane,
        pool: UpstreamPool,
        batches: OpenAIBatches,
        tls: ssl.SSLContext | None = None,
    ) -> None:
        self._config = config
        self._tls = tls
        self._edge = edge
        self._generation = generation
        self._embedding = embedding
        self._pool = pool
        self._batches = batches
        self._runner: web.AppRunner | None = None
        self._listener: asyncio.Server | None = None
        self.port: int | None = None

    def app(self) -> web.Application:
        app = web.Application(
            middlewares=[self._errors],
            client_max_size=max(self._config.max_body_bytes, self._config.max_file_bytes) + _MULTIPART_OVERHEAD,
        )
        routes: list[tuple[str, str, Handler]] = [
            ("POST", "/v1/chat/completions", self.chat_completions),
            ("POST", "/v1/completions", self.completions),
            ("POST", "/v1/embeddings", self.embeddings),
            ("GET", "/v1/models", self.models),
            ("GET", "/v1/models/{model}", self.model),
            ("POST", "/v1/files", self.upload_file),
            ("GET", "/v1/files", self.list_files),
            ("GET", "/v1/files/{file_id}", self.file),
            ("DELETE", "/v1/files/{file_id}", self.delete_file),
            ("GET", "/v1/files/{file_id}/content", self.file_content),
            ("POST", "/v1/batches", self.create_batch),
            ("GET", "/v1/batches", self.list_batches),
            ("GET", "/v1/batches/{batch_id}", self.batch),
            ("POST", "/v1/batches/{batch_id}/cancel", self.cancel_batch),
        ]
        for method, path, handler in routes:
            app.router.add_route(method, path, handler, expect_handler=self._expect)
        return app

    async def start(self) -> None:
        """Bind `config.listen` (port 0 picks a free one: see `.port`)."""
        host, _, port = self._config.listen.rpartition(":")
        runner = web.AppRunner(self.app(), handler_cancellation=True, shutdown_timeout=SHUTDOWN_GRACE_S)
        await runner.setup()
        server, loop = runner.server, asyncio.get_running_loop()
        assert server is not None  # set up above
        try:
            # Connections are served by `_RequestHandler` (aiohttp's own sites would use
            # aiohttp's plain-text answers to what its parser refuses).
            self._listener = await loop.create_server(
                # No access log (aiohttp takes None for off; its stubs say Logger).
                # Bodies are decoded by the routes (`_json`), not by aiohttp: a body that
                # did not decode as its Content-Encoding said would fail inside aiohttp,
                # with a logged traceback and a reset connection.
                lambda: _RequestHandler(server, loop=loop, access_log=None, auto_decompress=False),  # type: ignore[arg-type]
                host.strip("[]"),
                int(port),
                ssl=self._tls,
            )
        except OSError:
            await runner.cleanup()
            raise
        self._runner = runner
        self.port = int(self._listener.sockets[0].getsockname()[1])

    async def stop(self) -> None:
        if self._listener is not None:
            self._listener.close()
            self._listener = None
        if self._runner is not None:
            await self._runner.cleanup()
            self._runner = None

    # -- edge helpers ----------------------------------------------------------------------

    @web.middleware
    async def _errors(self, request: web.Request, handler: Handler) -> web.StreamResponse:
        """Every route: the caller identified before anything of the request is read (a
        caller without a valid key learns nothing but 401), and every failure answered
        with an OpenAI error object by the one error table."""
        try:
            if _CALL not in request:  # else admitted by `_expect`
                self._admit(request)
            return await handler(request)
        except ConnectionResetError:
            raise  # the client went away mid-response: aiohttp drops it quietly
        except web.HTTPException as e:
            if e.status < 400:
                raise
            return self._refusal(request, e)
        except Exception as e:
            return self._refusal(request, e)

    async def _expect(self, request: web.Request) -> web.StreamResponse | None:
        """A request sent with `Expect: 100-continue`: the client is told to send its body
        only once `_admit` has taken it: one without a valid key, with a bad timeout header
        or declaring too large a body gets its error before sending any of the body."""
        try:
            self._admit(request)
        except Exception as e:
            return self._refusal(request, e)
        if request.version != HttpVersion11:
            return None  # (HTTP/1.0 has no interim responses)
        expect = request.headers.get("expect", "")
        if expect.lower() != "100-continue":
            return _error_response(417, f"Expect: {expect!r} is not supported (only 100-continue)")
        await request.writer.write(b"HTTP/1.1 100 Continue\r\n\r\n")
        request.writer.output_size = 0  # the response proper has not started
        return None

    def _admit(self, request: web.Request) -> None:
        """The edge's part of every request, before its body: who calls, its time, and a
        body declared longer than the route takes refused (its reader would wait for all
        of it; a client waiting for 100-continue would send it)."""
        call = request[_CALL] = self._call(request)
        self._edge.identify(call)
        call.timeout_s = self._timeout(request)
        declared = request.content_length or 0
        resource = request.match_info.route.resource
        if resource is not None and resource.canonical == "/v1/files":
            # An upload: the file, and the multipart framing around it.
            if declared > self._config.max_file_bytes + _MULTIPART_OVERHEAD:
                raise errors.InvalidArgument(f"file is larger than {self._config.max_file_bytes} bytes")
        elif declared > self._config.max_body_bytes:
            raise errors.InvalidArgument(f"request body is larger than {self._config.max_body_bytes} bytes")

    def _refusal(self, request: web.Request, e: Exception) -> web.Response:
        """`e` as an OpenAI error object: domain errors by the table, aiohttp's own refusals
        (no such route, wrong method, body too large) by their status, anything else 500."""
        if isinstance(e, web.HTTPException):
            return _error_response(e.status, e.reason)
        if isinstance(e, RequestPayloadError):
            # A body that cannot be read as its headers frame it (chunks broken part-way).
            cause = e.__cause__
            reason = cause.message if isinstance(cause, BadHttpMessage) else str(e)
            return _error_response(400, f"request body could not be read: {reason}")
        decoded = request.get(_CALL)
        tenant = decoded.tenant if decoded is not None and isinstance(e, errors.QuotaExceeded) else None
        response = http_error(e, tenant)
        return web.json_response(response.body, status=response.status, headers=response.headers)

    def _call(self, request: web.Request) -> Call:
        """The request as the edge takes it: its headers (the key, a routing session id,
        a traceparent), and its verified client certificate (mutual TLS)."""
        transport = request.transport
        certificate = peer_certificate(transport.get_extra_info("ssl_object") if transport else None)
        # aiohttp decodes header bytes as UTF-8, those that are none as surrogate escapes:
        # encoded back the same way, they are the bytes the caller sent, whatever they are.
        headers = [
            (name.lower().encode("utf-8", "surrogateescape"), value.encode("utf-8", "surrogateescape"))
            for name, value in request.headers.items()
        ]
        rpc = _RPCS.get(request.match_info.route.resource.canonical if request.match_info.route.resource else "", "openai")
        return Call(rpc, headers, ConnectionCredentials(certificate))

    def _timeout(self, request: web.Request) -> float:
        """The seconds the caller gives its request: the least of the timeout headers it
        sent, else the configured default."""
        given = []
        for name in _TIMEOUT_HEADERS:
            value = request.headers.get(name)
            if value is None:
                continue
            try:
                seconds = float(value)
            except ValueError:
                seconds = math.nan
            if not 0 < seconds < math.inf:
                raise errors.InvalidArgument(f"header {name!r}: a timeout is a positive number of seconds")
            given.append(min(seconds, _LONGEST_TIMEOUT_S))
        return min(given) if given else self._config.request_timeout_s

    def _tenant(self, request: web.Request) -> Tenant:
        tenant = request[_CALL].tenant
        assert tenant is not None  # identified before any route runs
        return tenant

    def _priority(self, request: web.Request, service_tier: str | None) -> str:
        """The class asked for: `x-priority`, else the configured class of `service_tier`;
        "" for the tenant's default."""
        header = request.headers.get(PRIORITY_HEADER, "").strip()
        if header or service_tier is None:
            return header
        klass = self._config.service_tiers.get(service_tier)
        if klass is not None:
            return klass
        if service_tier in _DEFAULT_TIERS:
            return ""
        tiers = sorted({*self._config.service_tiers, *_DEFAULT_TIERS})
        raise errors.InvalidArgument(f"service_tier {service_tier!r} is not offered; tiers: {', '.join(tiers)}")

    async def _json(self, request: web.Request) -> Any:
        limit = self._config.max_body_bytes
        encoding = _content_encoding(request)
        # (A body declared over the limit was refused by `_admit`, before any of it was read.)
        if len(raw := await self._read_body(request, request.read())) > limit:
            raise errors.InvalidArgument(f"request body is larger than {limit} bytes")
        return wire.loads(raw if encoding is None else _decompressed(raw, encoding, limit))

    async def _read_body(self, request: web.Request, read: Awaitable[T]) -> T:
        """`read`, a read of the request's body, within the request's timeout: a client
        that stops sending part-way gets a 408 then, instead of holding its connection and
        a handler for as long as it likes."""
        try:
            async with asyncio.timeout(request[_CALL].timeout_s):
                return await read
        except TimeoutError:
            raise web.HTTPRequestTimeout(reason="the request body did not arrive within the request's timeout") from None

    # -- generation --------------------------------------------------------------------------

    async def chat_completions(self, request: web.Request) -> web.StreamResponse:
        body = wire.parse(wire.ChatCompletionRequest, await self._json(request))
        return await self._generate(request, body, chat=True)

    async def completions(self, request: web.Request) -> web.StreamResponse:
        body = wire.parse(wire.CompletionRequest, await self._json(request))
        return await self._generate(request, body, chat=False)

    async def _generate(
        self, request: web.Request, body: wire.ChatCompletionRequest | wire.CompletionRequest, *, chat: bool
    ) -> web.StreamResponse:
        generation = to_call(body.generate_request(), stream=body.stream)
        call = request[_CALL]
        call.priority_class = self._priority(request, body.service_tier) or None
        completion_id = f"{'chatcmpl' if chat else 'cmpl'}-{uuid.uuid4().hex}"
        created = wire.now()
        try:
            async with contextlib.aclosing(self._generation.generate(call, generation)) as items:
                if body.stream:
                    return await self._stream(request, items, body, chat, completion_id, created)
                texts: list[str] = []
                async for item in items:
                    if isinstance(item, Finished):
                        result = wire.completion_of(chat, completion_id, body.model, created, "".join(texts), item)
                        return web.json_response(result)
                    texts.append(item)
                raise errors.Internal("generation ended without a result")
        except _StreamFailed as e:
            return e.response

    async def _stream(
        self,
        request: web.Request,
        items: AsyncGenerator[str | Finished, None],
        body: wire.ChatCompletionRequest | wire.CompletionRequest,
        chat: bool,
        completion_id: str,
        created: int,
    ) -> web.StreamResponse:
        # The first item comes after authentication, admission and scheduling: waiting for
        # it before sending headers lets those refusals keep their HTTP status (401, 429...).
        first = await anext(items)
        response = web.StreamResponse(headers={"content-type": "text/event-stream", "cache-control": "no-cache"})
        await response.prepare(request)
        usage_field = body.include_usage

        async def send(event: dict[str, Any]) -> None:
            await response.write(b"data: " + json.dumps(event).encode() + b"\n\n")

        if chat:
            await send(wire.chunk(chat, completion_id, body.model, created, text="", role=True, with_usage_field=usage_field))
        item: str | Finished = first
        try:
            while True:
                if isinstance(item, Finished):
                    reason = wire.FINISH_REASONS[item.finish_reason]
                    await send(
                        wire.chunk(chat, completion_id, body.model, created, finish_reason=reason, with_usage_field=usage_field)
                    )
                    if usage_field:
                        await send(wire.usage_chunk(chat, completion_id, body.model, created, item))
                    break
                await send(wire.chunk(chat, completion_id, body.model, created, text=item, with_usage_field=usage_field))
                item = await anext(items)
        except errors.GatewayError as e:
            # Headers are gone: the error travels as an event, the way OpenAI's SDKs read it.
            await send(http_error(e).body)
            raise _StreamFailed(e, response) from e
        await response.write(b"data: [DONE]\n\n")
        await response.write_eof()
        return response

    # -- embeddings and models ---------------------------------------------------------------

    async def embeddings(self, request: web.Request) -> web.StreamResponse:
        body = wire.parse(wire.EmbeddingRequest, await self._json(request))
        proto = body.embed_request()
        call = request[_CALL]
        call.model = proto.model
        call.priority_class = self._priority(request, body.service_tier) or None
        result = await self._embedding.embed(call, list(proto.inputs))
        return web.json_response(wire.embeddings_of(body.model, result, body))

    async def models(self, request: web.Request) -> web.StreamResponse:
        tenant = self._tenant(request)
        names = [n for n in self._pool.ready_models() if tenant.allows_model(n)]
        return web.json_response({"object": "list", "data": [wire.model_entry(n) for n in names]})

    async def model(self, request: web.Request) -> web.StreamResponse:
        tenant = self._tenant(request)
        name = request.match_info["model"]
        if not tenant.allows_model(name) or name not in self._pool.ready_models():
            raise errors.NotFound(f"no model {name!r}")
        return web.json_response(wire.model_entry(name))

    # -- files and batches -------------------------------------------------------------------

    async def upload_file(self, request: web.Request) -> web.StreamResponse:
        tenant = self._tenant(request)
        purpose, filename, content = await self._multipart_file(request)
        return web.json_response(await self._batches.upload(tenant, purpose=purpose, filename=filename, content=content))

    async def _multipart_file(self, request: web.Request) -> tuple[str, str, bytes]:
        if not request.content_type.startswith("multipart/form-data"):
            raise errors.InvalidArgument("upload the file as multipart/form-data (fields 'file' and 'purpose')")
        if _content_encoding(request) is not None:
            raise web.HTTPUnsupportedMediaType(reason="send the upload without a Content-Encoding")
        return await self._read_body(request, self._multipart_parts(request))

    async def _multipart_parts(self, request: web.Request) -> tuple[str, str, bytes]:
        purpose: str | None = None
        filename = ""
        content: bytes | None = None
        try:
            reader = await request.multipart()
            while (part := await reader.next()) is not None:
                if not isinstance(part, BodyPartReader):
                    raise errors.InvalidArgument("nested multipart bodies are not supported")
                if part.name == "purpose":
                    purpose = (await part.read(decode=True)).decode().strip()
                elif part.name == "file":
                    filename = part.filename or "upload.jsonl"
                    chunks = bytearray()
                    while chunk := await part.read_chunk():
                        chunks += chunk
                        if len(chunks) > self._config.max_file_bytes:
                            raise errors.InvalidArgument(f"file is larger than {self._config.max_file_bytes} bytes")
                    content = bytes(chunks)
                else:
                    await part.release()
        except (ValueError, LookupError, AssertionError, BadHttpMessage) as e:
            # aiohttp's multipart reader raises these on bytes that are no multipart body
            # (no boundary, a broken one, a body cut short, an unknown charset).
            raise errors.InvalidArgument(f"malformed multipart body: {e}") from None
        if purpose is None or content is None:
            raise errors.InvalidArgument("multipart fields 'file' and 'purpose' are required")
        return purpose, filename, content

    async def list_files(self, request: web.Request) -> web.StreamResponse:
        tenant = self._tenant(request)
        order = request.query.get("order", "desc")
        if order not in ("asc", "desc"):
            raise errors.InvalidArgument("order must be 'asc' or 'desc'")
        return web.json_response(
            await self._batches.list_files(
                tenant,
                purpose=request.query.get("purpose") or None,
                limit=_page_size(request),
                after=request.query.get("after") or None,
                ascending=order == "asc",
            )
        )

    async def delete_file(self, request: web.Request) -> web.StreamResponse:
        return web.json_response(await self._batches.delete_file(self._tenant(request), request.match_info["file_id"]))

    async def file(self, request: web.Request) -> web.StreamResponse:
        return web.json_response(await self._batches.file(self._tenant(request), request.match_info["file_id"]))

    async def file_content(self, request: web.Request) -> web.StreamResponse:
        content = await self._batches.file_content(self._tenant(request), request.match_info["file_id"])
        return web.Response(body=content, content_type="application/octet-stream")

    async def create_batch(self, request: web.Request) -> web.StreamResponse:
        tenant = self._tenant(request)
        body = wire.parse(BatchCreateRequest, await self._json(request))
        return web.json_response(await self._batches.create(tenant, body))

    async def list_batches(self, request: web.Request) -> web.StreamResponse:
        tenant = self._tenant(request)
        return web.json_response(
            await self._batches.list_batches(tenant, limit=_page_size(request), after=request.query.get("after") or None)
        )

    async def batch(self, request: web.Request) -> web.StreamResponse:
        return web.json_response(await self._batches.get(self._tenant(request), request.match_info["batch_id"]))

    async def cancel_batch(self, request: web.Request) -> web.StreamResponse:
        return web.json_response(await self._batches.cancel(self._tenant(request), request.match_info["batch_id"]))


def _page_size(request: web.Request) -> int:
    """A list's `limit` query parameter: DEFAULT_PAGE_SIZE, or 1 to MAX_PAGE_SIZE."""
    try:
        limit = int(request.query.get("limit", DEFAULT_PAGE_SIZE))
    except ValueError:
        raise errors.InvalidArgument("limit must be an integer") from None
    if not 1 <= limit <= MAX_PAGE_SIZE:
        raise errors.InvalidArgument(f"limit must be in [1, {MAX_PAGE_SIZE}]")
    return limit


class _StreamFailed(Exception):
    """A stream that failed after its headers went out; its response is already written."""

    def __init__(self, error: errors.GatewayError, response: web.StreamResponse) -> None:
        super().__init__(error.message)
        self.error = error
        self.response = response


# Content-Encodings of a JSON body the API decodes: zlib reads both headers (32 + wbits).
_ZLIB_ENCODINGS = {"gzip", "x-gzip", "deflate"}


def _content_encoding(request: web.Request) -> str | None:
    """The body's Content-Encoding (None: not encoded); 415 for one the API does not take."""
    encoding = request.headers.get("content-encoding", "").strip().lower()
    if encoding in ("", "identity"):
        return None
    if encoding not in _ZLIB_ENCODINGS:
        raise web.HTTPUnsupportedMediaType(reason=f"Content-Encoding {encoding!r} is not supported: send gzip, deflate or none")
    return encoding


_GZIP_MAGIC = b"\x1f\x8b"


def _decompressed(raw: bytes, encoding: str, limit: int) -> bytes:
    """`raw` decoded, refused once it decodes past `limit` bytes (a small body may inflate
    to gigabytes) or when it does not decode as `encoding`: a gzip body may hold several
    members (RFC 1952), each read; anything else after the stream is no part of it."""
    body = b""
    while True:
        decoder = zlib.decompressobj(32 + zlib.MAX_WBITS)
        try:
            body += decoder.decompress(raw, limit + 1 - len(body))
        except zlib.error as e:
            raise errors.InvalidArgument(f"request body does not decode as {encoding}: {e}") from None
        if len(body) > limit:
            raise errors.InvalidArgument(f"request body is larger than {limit} bytes decoded")
        if not decoder.eof:
            raise errors.InvalidArgument(f"request body is cut short: its {encoding} stream does not end")
        raw = decoder.unused_data
        if not raw:
            return body
        if not raw.startswith(_GZIP_MAGIC) or encoding == "deflate":
            raise errors.InvalidArgument(f"request body holds {len(raw)} bytes after its {encoding} stream")


def _error_response(status: int, message: str) -> web.Response:
    """An OpenAI error object for a refusal that is no domain error (aiohttp's own)."""
    return web.json_response(
        {"error": {"message": message, "type": "invalid_request_error", "param": None, "code": None}}, status=status
    )


class _RequestHandler(RequestHandler):
    """aiohttp's connection handler, answering a request its HTTP parser refused (a header
    over the size limit, a malformed request line) with an OpenAI error object instead of
    plain text, and logging it only at debug level: anyone can send such requests, and
    they must not fill the log."""

    def handle_error(
        self, request: BaseRequest, status: int = 500, exc: BaseException | None = None, message: str | None = None
    ) -> web.StreamResponse:
        if status < 500:
            self.logger.debug("refused a request from %s: %s", request.remote, exc)
            response = _error_response(status, message or HTTPStatus(status).phrase)
            response.force_close()
            return response
        return super().handle_error(request, status, exc, message)
