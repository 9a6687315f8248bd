"""The relay's front: gRPC calls from tenants' HTTP/2 connections, forwarded as frames.

Each call is routed by `:path` prefix to an upstream pool. Calls on a route with a policy
wait for their first message, ask the policy, and then either go upstream (headers set,
bytes appended to that message) or get the policy's status from the relay itself. Calls on
a route without a policy go upstream as soon as their headers arrive. After that the relay
only moves frames: DATA both ways under end-to-end flow control (see peer.py), response
headers and trailers as Triton wrote them, RST_STREAM both ways, the deadline from
`grpc-timeout` enforced here as well as upstream.
"""

from __future__ import annotations

import asyncio
import logging
import ssl
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from qosgate.auth import ConnectionCredentials
from qosgate.relay.messages import Handler, ServerStream
from qosgate.relay.policy import CONNECTION_FULL, CallEnd, CallHead, CallPolicy, Decision, Forward
from qosgate.tls import PEER_HEADER_PREFIX, certificate_headers, peer_certificate
from qosgate.transport import framing, http2
from qosgate.transport.peer import Flusher, Peer, Pipe
from qosgate.transport.status import (
    CUT_SHORT,
    DEADLINE_EXCEEDED,
    INTERNAL,
    RESOURCE_EXHAUSTED,
    UNAVAILABLE,
    UNIMPLEMENTED,
    Refuse,
    bounded_messages,
    status_headers,
)
from qosgate.upstream.connections import ConnectionPool, UpstreamConnection

log = logging.getLogger(__name__)

_GRPC_TIMEOUT = b"grpc-timeout"
_GRPC_ENCODING = b"grpc-encoding"
_CANCEL = int(http2.ErrorCode.CANCEL)
_REFUSED_STREAM = int(http2.ErrorCode.REFUSED_STREAM)
# Response messages of a route without a bound are counted only (its server bounds them).
_UNBOUNDED = 1 << 32


@dataclass(frozen=True, slots=True)
class Route:
    """Calls whose `:path` starts with `prefix` go to `pool`, asking `policy` first if set;
    a response message over `max_response_size` fails the call RESOURCE_EXHAUSTED."""

    prefix: bytes
    pool: ConnectionPool | None  # None: the policy names each call's upstream
    policy: CallPolicy | None = None
    max_response_size: int = _UNBOUNDED


@dataclass(frozen=True, slots=True)
class Served:
    """Calls whose `:path` starts with `prefix` are served by `handler` message by message
    (messages.ServerStream), not relayed."""

    prefix: bytes
    handler: Handler


class Call:
    """One relayed gRPC call: a caller's stream joined to an upstream stream."""

    __slots__ = (
        "down", "down_id", "up", "up_id", "headers", "route", "request", "response",
        "first", "pending", "client_done", "responded", "finished", "on_finish",
        "requests", "responses", "deadline", "timer", "decision_task", "sent_headers", "replay",
        "charged",
    )  # fmt: skip

    def __init__(self, down: DownstreamConnection, stream_id: int, headers: Sequence[http2.Header]) -> None:
        self.down = down
        self.down_id = stream_id
        self.up: UpstreamConnection | None = None
        self.up_id = 0
        self.headers = headers
        self.route: Route | None = None
        self.request = Pipe(down, stream_id)  # caller → upstream
        self.response: Pipe | None = None  # upstream → caller, once upstream exists
        self.first: framing.FirstMessage | None = None  # while a policy waits for it
        self.pending: list[bytes] = []  # request bytes held until the upstream stream opens
        self.client_done = False  # the caller sent END_STREAM
        self.responded = False  # response headers went to the caller
        self.finished = False
        self.on_finish: Forward | None = None
        self.requests = framing.MessageScanner(down.relay.max_message_size)
        self.responses = framing.MessageScanner(_UNBOUNDED)
        self.deadline: float | None = None
        self.timer: asyncio.TimerHandle | None = None
        self.decision_task: asyncio.Future[Decision] | None = None
        self.sent_headers: Sequence[http2.Header] = ()
        # The whole request as sent upstream, kept until the first response so that a
        # call the upstream failed before answering can go to another one (Forward.failover).
        self.replay: bytes | None = None
        # Bytes of this call's first message counted against its connection's
        # `pending_bytes` (read and acknowledged before the policy decided).
        self.charged = 0

    # -- from the caller ------------------------------------------------------------------

    def start(self, route: Route | None, end_stream: bool) -> None:
        relay = self.down.relay
        if route is None:
            path = http2.header(self.headers, b":path") or b""
            self.refuse(Refuse(UNIMPLEMENTED, f"no route for {path.decode(errors='replace')}"))
            return
        self.route = route
        self.responses = framing.MessageScanner(route.max_response_size)
        timeout = http2.header(self.headers, _GRPC_TIMEOUT)
        if timeout is not None:
            seconds = framing.parse_timeout(timeout)
            if seconds is not None:
                loop = relay.loop
                self.deadline = loop.time() + seconds
                self.timer = loop.call_at(self.deadline, self.deadline_passed)
        self.client_done = end_stream
        if route.policy is None:
            assert route.pool is not None, "a route without a policy has a pool"
            self.forward(route.pool, self.down.pass_on(self.headers), end_stream)
        elif end_stream:  # no message at all: the policy decides on the headers alone
            self.decide(b"")
        else:
            self.first = framing.FirstMessage(relay.max_message_size)

    def client_data(self, data: bytes, end_stream: bool) -> None:
        request = self.request
        request.received(len(data))
        if end_stream:
            self.client_done = True
        if self.finished:
            request.release(len(data))
            return
        try:
            self.requests.scan(data)
        except framing.MessageTooLarge as e:
            request.release(len(data))
            self.fail(Refuse(RESOURCE_EXHAUSTED, str(e)))
            return
        first = self.first
        if first is not None:
            # The policy must see the whole first message: its bytes are read here and
            # acknowledged at once (bounded by the size limit, not by the window), and
            # counted against the connection's bound until the policy has decided.
            request.release(len(data))
            if not self.charge(len(data)):
                return
            if first.add(data):
                self.first = None
                if first.rest:
                    self.hold(first.rest)
                self.decide_on(first)
            elif end_stream:
                self.fail(CUT_SHORT)
            return
        if self.up is None:
            self.hold(data)
            return
        request.push(data, end_stream=end_stream)

    def charge(self, size: int) -> bool:
        """Count `size` more bytes held for the policy against the connection's bound;
        over it, the call is refused (False) and its count given back."""
        down = self.down
        self.charged += size
        down.pending_bytes += size
        if down.pending_bytes > down.relay.max_connection_pending:
            self.fail(CONNECTION_FULL)
            return False
        return True

    def uncharge(self) -> None:
        """The policy decided, or the call ended: its first message no longer counts."""
        if self.charged:
            self.down.pending_bytes -= self.charged
            self.charged = 0

    def hold(self, data: bytes) -> None:
        """Keep request bytes (unacknowledged: the caller's window bounds them) until forwarding."""
        self.pending.append(data)
        self.request.held += len(data)

    def client_reset(self, error_code: int) -> None:
        if self.up is not None:
            self.up.h2.reset(self.up_id, error_code)
            self.up.touch()
        self.end(None, error_code)

    def client_closed(self) -> None:
        """The caller's stream is gone; a call still going upstream is cancelled there."""
        self.uncharge()
        if not self.finished:
            if self.up is not None:
                self.up.h2.reset(self.up_id, _CANCEL)
                self.up.touch()
            self.end(None, _CANCEL)
        if self.response is not None:
            self.response.drop()
        # Request bytes stay unacknowledged until the upstream has written them out.
        self.pending.clear()
        self.request.held = 0
        if self.up is None:
            self.request.drop()

    # -- the policy -------------------------------------------------------------------------

    def decide_on(self, first: framing.FirstMessage) -> None:
        payload = first.payload or b""
        message = payload
        if first.compressed:
            encoding = http2.header(self.headers, _GRPC_ENCODING) or b"identity"
            try:
                message = framing.decompress(encoding, payload, self.down.relay.max_message_size)
            except framing.FramingError as e:
                self.fail(Refuse(e.status, str(e)))
                return
            if not self.charge(len(message)):  # held beside the compressed bytes until the decision
                return
        self.decide(message, first)

    def decide(self, message: bytes | memoryview, first: framing.FirstMessage | None = None) -> None:
        assert self.route is not None and self.route.policy is not None
        left = None if self.deadline is None else self.deadline - self.down.relay.loop.time()
        head = CallHead(http2.header(self.headers, b":path") or b"", self.headers, message, left, self.down.caller)
        try:
            decision = self.route.policy(head)
        except Exception:
            log.exception("relay policy failed")
            self.fail(Refuse(INTERNAL, "internal error"))
            return
        if isinstance(decision, (Forward, Refuse)):
            self.apply(decision, message, first, waited=False)
            return
        self.decision_task = asyncio.ensure_future(decision)
        self.decision_task.add_done_callback(lambda task: self.decided_later(task, message, first))

    def decided_later(
        self, task: asyncio.Future[Decision], message: bytes | memoryview, first: framing.FirstMessage | None
    ) -> None:
        self.decision_task = None
        if task.cancelled():
            return  # the call ended while it waited
        error = task.exception()
        if error is not None:
            log.error("relay policy failed", exc_info=error)
            self.fail(Refuse(INTERNAL, "internal error"))
        elif self.finished:
            decision = task.result()
            if isinstance(decision, Forward) and decision.on_finish is not None:
                self.on_finish = decision
                self.report(None, _CANCEL)
        else:
            self.apply(task.result(), message, first, waited=True)

    def apply(
        self, decision: Decision, message: bytes | memoryview, first: framing.FirstMessage | None, *, waited: bool
    ) -> None:
        # Forwarded, the message is the upstream's to take (its window bounds it); refused, it is dropped.
        self.uncharge()
        if isinstance(decision, Refuse):
            self.refuse(decision)
            return
        self.on_finish = decision
        headers = _merge(self.headers, decision.set_headers, decision.drop_headers)
        if waited and self.deadline is not None:
            left = self.deadline - self.down.relay.loop.time()
            headers = _merge(headers, ((_GRPC_TIMEOUT, framing.format_timeout(left)),))
        if first is not None:
            if decision.append:
                # Appended bytes cannot go inside a compressed message: send it plain.
                resent = framing.frame(message, decision.append)
            else:
                resent = framing.frame(first.payload or b"", compressed=first.compressed)
            self.pending.insert(0, resent)
            self.request.credit = len(resent)  # its bytes were acknowledged as they came
            if decision.failover is not None and self.client_done and not any(self.pending[1:]):
                self.replay = resent
        assert self.route is not None
        pool = decision.upstream or self.route.pool
        if pool is None:  # a bug of the policy: it named no upstream
            self.fail(Refuse(INTERNAL, "internal error"))
            return
        self.forward(pool, headers, self.client_done and not self.pending)

    # -- upstream ---------------------------------------------------------------------------

    def forward(self, pool: ConnectionPool, headers: Sequence[http2.Header], end_stream: bool) -> None:
        self.sent_headers = headers
        up = pool.pick()
        if up is None:
            # The upstream's connections are down (its health check may not know yet).
            if not self.fail_over():
                self.fail(Refuse(UNAVAILABLE, "no upstream connection"))
            return
        self.up = up
        self.up_id = up.open_stream(headers, self, end_stream=end_stream)
        self.response = Pipe(up, self.up_id)
        self.response.sink, self.response.sink_id = self.down, self.down_id
        request = self.request
        request.sink, request.sink_id = up, self.up_id
        if self.pending:
            pending, self.pending = self.pending, []
            request.held = 0
            last = len(pending) - 1
            for index, chunk in enumerate(pending):
                request.push(chunk, end_stream=self.client_done and index == last)

    def fail_over(self) -> bool:
        """Send the held request to the upstream the policy names instead, once; False
        when there is none (or the request is not held whole)."""
        replay, self.replay = self.replay, None
        decision = self.on_finish
        if replay is None or decision is None or decision.failover is None or self.finished:
            return False
        pool = decision.failover()
        if pool is None:
            return False
        if self.up is not None:
            self.up.abandon(self.up_id)
        self.up = None
        self.pending = [replay]
        self.request.pushed = 0
        self.request.credit = len(replay)
        self.forward(pool, self.sent_headers, False)
        return True

    def upstream_headers(self, headers: Sequence[http2.Header], end_stream: bool) -> None:
        if self.finished:
            return
        if self.replay is not None:
            if end_stream and _status_of(headers) == UNAVAILABLE and self.fail_over():
                return
            self.replay = None
        self.responded = True
        self.down.h2.send_response(self.down_id, bounded_messages(headers), end_stream=end_stream)
        self.down.touch()
        if end_stream:  # trailers-only: the status is in these headers
            self.end(_status_of(headers), None)

    def upstream_data(self, data: bytes, end_stream: bool) -> None:
        response = self.response
        assert response is not None
        response.received(len(data))
        if self.finished or not self.responded:
            response.release(len(data))
            return
        try:
            self.responses.scan(data)
        except framing.MessageTooLarge as e:
            response.release(len(data))
            self.fail(Refuse(RESOURCE_EXHAUSTED, str(e)))
            return
        response.push(data, end_stream=end_stream)
        if end_stream:
            self.end(None, None)

    def upstream_trailers(self, headers: Sequence[http2.Header]) -> None:
        if self.finished:
            return
        self.down.h2.send_trailers(self.down_id, bounded_messages(headers))
        self.down.touch()
        self.end(_status_of(headers), None)

    def upstream_reset(self, error_code: int) -> None:
        if self.finished:
            return
        if error_code == _REFUSED_STREAM and not self.responded and self.fail_over():
            return
        self.down.h2.reset(self.down_id, error_code)
        self.down.touch()
        self.end(None, error_code)

    def upstream_closed(self) -> None:
        """Nothing to do: response bytes stay unacknowledged until the caller's side wrote
        them out, and request bytes settle as the closed stream reports nothing queued."""

    def upstream_lost(self) -> None:
        if self.response is not None:
            self.response.drop()
        if self.finished or (not self.responded and self.fail_over()):
            return
        self.fail(Refuse(UNAVAILABLE, "upstream connection lost"))

    # -- ends -------------------------------------------------------------------------------

    def deadline_passed(self) -> None:
        self.timer = None
        if not self.finished:
            if self.up is not None:
                self.up.h2.reset(self.up_id, _CANCEL)
                self.up.touch()
            self.fail(Refuse(DEADLINE_EXCEEDED, "Deadline Exceeded"))

    def refuse(self, refusal: Refuse) -> None:
        """Answer with a status before any response went out (trailers-only)."""
        self.down.h2.send_response(
            self.down_id,
            [(b":status", b"200"), (b"content-type", b"application/grpc"), *status_headers(refusal)],
            end_stream=True,
        )
        self.down.touch()
        self.end(refusal.status, None)

    def fail(self, refusal: Refuse) -> None:
        """End the call with the relay's own status, whatever was already sent."""
        if self.finished:
            return
        if self.up is not None:
            self.up.h2.reset(self.up_id, _CANCEL)
            self.up.touch()
        if not self.responded:
            self.refuse(refusal)
        else:
            self.down.h2.send_trailers(self.down_id, status_headers(refusal))
            self.down.touch()
            self.end(refusal.status, None)

    def end(self, status: int | None, reset_code: int | None) -> None:
        if self.finished:
            return
        self.finished = True
        self.replay = None
        self.uncharge()
        if self.timer is not None:
            self.timer.cancel()
            self.timer = None
        if self.decision_task is not None:
            self.decision_task.cancel()  # stop waiting for admission or a slot
        self.report(status, reset_code)

    def report(self, status: int | None, reset_code: int | None) -> None:
        """Tell the policy how the call ended, once what ended it has been written."""
        decision, self.on_finish = self.on_finish, None
        if decision is None or decision.on_finish is None:
            return
        end = CallEnd(status, reset_code, self.requests.count, self.responses.count)
        self.down.relay.flusher.later(decision.on_finish, end)


# Calls one connection starts per pass of the event loop: a caller whose burst brings many
# at once (a tight loop of refused retries, say) goes on in the next pass, after the other
# connections' calls that are ready by then.
CALLS_PER_PASS = 8


class DownstreamConnection(Peer):
    """A tenant's HTTP/2 connection (server role)."""

    def __init__(self, relay: Relay) -> None:
        super().__init__(relay.flusher, server=True, max_concurrent_streams=relay.max_concurrent_streams)
        self.relay = relay
        self.calls: dict[int, Call | ServerStream] = {}
        # Request bytes read for policies still deciding, over all of this connection's calls.
        self.pending_bytes = 0
        self.caller = ConnectionCredentials()  # with the verified TLS certificate, if any
        # Events left for the next pass of the event loop (CALLS_PER_PASS), and any after them.
        self._backlog: list[http2.Event] | None = None
        self._certificate_headers: list[http2.Header] = []

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.relay.clients.add(self)
        # Over TLS the handshake (and client certificate verification) is done by now.
        certificate = peer_certificate(transport.get_extra_info("ssl_object"))
        self.caller = ConnectionCredentials(certificate)
        if certificate is not None:
            self._certificate_headers = certificate_headers(certificate)
        super().connection_made(transport)

    def pass_on(self, headers: Sequence[http2.Header]) -> list[http2.Header]:
        """A call's headers for a server behind a route without a policy (the gateway's
        grpcio server): the caller's verified certificate set, any such header it sent dropped."""
        return [*(h for h in headers if not h[0].startswith(PEER_HEADER_PREFIX)), *self._certificate_headers]

    def handle(self, events: list[http2.Event]) -> None:
        if self._backlog is not None:  # an earlier burst waits for the next pass: after it
            self._backlog.extend(events)
            return
        # Most frequent first: this runs for every frame a caller sends, and a unary call
        # brings two WINDOW_UPDATEs (nothing to do: the session applies them itself).
        calls = self.calls
        started = 0
        for index, event in enumerate(events):
            if isinstance(event, http2.WindowUpdated):
                continue
            if isinstance(event, http2.DataReceived):
                call = calls.get(event.stream_id)
                if call is not None:
                    call.client_data(event.data, event.end_stream)
                else:
                    self.h2.acknowledge(event.stream_id, len(event.data))
            elif isinstance(event, http2.RequestReceived):
                if started == CALLS_PER_PASS:
                    self._backlog = events[index:]
                    self.relay.loop.call_soon(self._resume)
                    return
                started += 1
                headers = http2.trimmed(event.headers)
                route = self.relay.route_of(http2.header(headers, b":path") or b"")
                if isinstance(route, Served):
                    served = ServerStream(self, event.stream_id, headers, route.handler)
                    calls[event.stream_id] = served
                    if event.end_stream:
                        served.client_data(b"", True)
                else:
                    call = Call(self, event.stream_id, headers)
                    calls[event.stream_id] = call
                    call.start(route, event.end_stream)
            elif isinstance(event, http2.StreamClosed):
                call = calls.pop(event.stream_id, None)
                if call is not None:
                    call.client_closed()
            elif isinstance(event, http2.StreamReset):
                call = calls.get(event.stream_id)
                if call is not None:
                    call.client_reset(event.error_code)
            elif isinstance(event, http2.TrailersReceived):
                call = calls.get(event.stream_id)
                if call is not None:  # gRPC callers send none; treat as the end of input
                    call.client_data(b"", True)
            elif isinstance(event, http2.GoAwayReceived):
                self.went_away = True

    def _resume(self) -> None:
        events, self._backlog = self._backlog, None
        if events is not None and not self.closed:
            self.handle(events)

    def lost(self) -> None:
        self.relay.clients.discard(self)
        self._backlog = None
        calls, self.calls = self.calls, {}
        for call in calls.values():
            call.client_closed()


class Relay:
    """The HTTP/2 gRPC relay: its upstream pools, routes, limits and listening socket."""

    def __init__(
        self,
        *,
        max_message_size: int = 64 << 20,
        max_concurrent_streams: int = 1000,
        max_connection_pending: int = 256 << 20,
        tls: ssl.SSLContext | None = None,
    ) -> None:
        """`max_connection_pending`: request bytes one client connection may have read and
        waiting for policies to decide (first messages, acknowledged as they arrive so that
        the caller's window does not bound them); a call whose bytes would go over it is
        refused RESOURCE_EXHAUSTED. `tls`: terminate TLS on the listener (its ALPN must
        offer h2)."""
        self._tls = tls
        self.routes: list[Route | Served] = []
        self.max_message_size = max_message_size
        self.max_concurrent_streams = max_concurrent_streams
        self.max_connection_pending = max_connection_pending
        self.flusher = Flusher()
        self.loop = asyncio.get_running_loop()
        self._pools: list[ConnectionPool] = []
        self.clients: set[DownstreamConnection] = set()
        # Handlers serving calls (`serve` routes), awaited at close.
        self.serving: set[asyncio.Task[None]] = set()
        self._server: asyncio.Server | None = None

    def upstream(self, address: str, *, connections: int = 2, tls: ssl.SSLContext | None = None) -> ConnectionPool:
        """A pool of connections to `address` (`host:port` or `unix:/path`, over TLS with
        `tls`); start() it."""
        pool = ConnectionPool(self.flusher, address, size=connections, tls=tls)
        self._pools.append(pool)
        return pool

    def route(
        self,
        prefix: bytes,
        pool: ConnectionPool | None,
        policy: CallPolicy | None = None,
        *,
        max_response_size: int = _UNBOUNDED,
    ) -> None:
        """Calls whose `:path` starts with `prefix` go to `pool` (first match wins)."""
        self.routes.append(Route(prefix, pool, policy, max_response_size))

    def serve(self, prefix: bytes, handler: Handler) -> None:
        """Calls whose `:path` starts with `prefix` are served by `handler`, one message at
        a time (first match wins, as for `route`)."""
        self.routes.append(Served(prefix, handler))

    def route_of(self, path: bytes) -> Route | Served | None:
        for route in self.routes:
            if path.startswith(route.prefix):
                return route
        return None

    async def listen(self, host: str, port: int) -> int:
        """Accept connections on host:port (0 picks one); returns the port."""
        self._server = await self.loop.create_server(lambda: DownstreamConnection(self), host, port, ssl=self._tls)
        server: Any = self._server  # its `sockets` is a list under uvloop, not the stubs' tuple
        return int(server.sockets[0].getsockname()[1])

    async def close(self) -> None:
        if self._server is not None:
            self._server.close()
        for client in list(self.clients):
            client.abort()
        for task in self.serving:
            task.cancel()
        await asyncio.gather(*self.serving, return_exceptions=True)
        for pool in self._pools:
            await pool.stop()
        if self._server is not None:
            await self._server.wait_closed()


def _merge(
    headers: Sequence[http2.Header], changes: Sequence[http2.Header], drop: frozenset[bytes] = frozenset()
) -> Sequence[http2.Header]:
    """`headers` without the fields named in `drop`, and with each of `changes` replacing
    the fields of its name, or added at the end."""
    if not changes and not drop:
        return headers
    names = drop.union(name for name, _ in changes)
    return [h for h in headers if h[0] not in names] + list(changes)


def _status_of(headers: Sequence[http2.Header]) -> int | None:
    value = http2.header(headers, b"grpc-status")
    return int(value) if value is not None and value.isdigit() else None

