"""A pool of Triton gRPC endpoints with health tracking and least-loaded choice.

Calls go out as bytes: each upstream holds one grpc.aio channel and one bytes-in/bytes-out
multicallable per KServe method, made once, so the hot path neither re-encodes messages
nor builds stubs. Health is Triton's own ServerReady, polled in the background; a call
that fails with UNAVAILABLE triggers an immediate check of its upstream, so traffic moves
away from a dead Triton without waiting for the poll.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import logging
from collections.abc import Callable, Coroutine, Iterator, Sequence
from typing import Any

import grpc
from tritonclient.grpc import service_pb2

from qosgate.config import UpstreamConfig
from qosgate.errors import Unavailable
from qosgate.tls import channel_credentials

log = logging.getLogger(__name__)

SERVICE = "inference.GRPCInferenceService"
METHODS = tuple(m.name for m in service_pb2.DESCRIPTOR.services_by_name["GRPCInferenceService"].methods)
_SERVER_READY = service_pb2.ServerReadyRequest().SerializeToString()

# Triton's own limit is 2 GiB; gRPC's default 4 MiB would refuse ordinary batches of tensors.
_CHANNEL_OPTIONS = (
    ("grpc.max_send_message_length", -1),
    ("grpc.max_receive_message_length", -1),
    ("grpc.keepalive_time_ms", 30_000),
)

HealthListener = Callable[[bool], Coroutine[Any, Any, None]]


class Upstream:
    """One Triton endpoint: its channel, per-method callables, health and load."""

    __slots__ = ("name", "url", "tls", "channel", "in_flight", "healthy", "_unary", "_stream")


    def __init__(self, config: UpstreamConfig) -> None:
        self.name = config.name
        self.url = config.url
        self.tls = config.tls
        self.in_flight = 0
        self.healthy = False
        self.channel: grpc.aio.Channel | None = None
        self._unary: dict[str, grpc.aio.UnaryUnaryMultiCallable] = {}
        self._stream: grpc.aio.StreamStreamMultiCallable | None = None

    def open(self) -> None:
        """Create the channel; inside the event loop that will use it (grpc.aio binds to it)."""
        channel = self.channel = (
            grpc.aio.insecure_channel(self.url, options=_CHANNEL_OPTIONS)
            if self.tls is None
            else grpc.aio.secure_channel(self.url, channel_credentials(self.tls), options=_CHANNEL_OPTIONS)
        )
        # No serializers: bytes go out and come back as they are on the wire.
        self._unary = {
            m: channel.unary_unary(f"/{SERVICE}/{m}") for m in METHODS if m != "ModelStreamInfer"
        }
        self._stream = channel.stream_stream(f"/{SERVICE}/ModelStreamInfer")

    def unary(self, method: str) -> grpc.aio.UnaryUnaryMultiCallable:
        return self._unary[method]

    def stream(self) -> grpc.aio.StreamStreamMultiCallable:
        assert self._stream is not None, "upstream not opened"
        return self._stream

    @contextlib.contextmanager
    def lease(self) -> Iterator[Upstream]:
        """Count a call against this upstream for as long as the block runs."""
        self.in_flight += 1
        try:
            yield self
        finally:
            self.in_flight -= 1


class UpstreamPool:
    """Healthy-upstream selection (least in flight, round-robin among ties) and health polls."""

    def __init__(
        self,
        configs: Sequence[UpstreamConfig],
        *,
        check_interval_s: float = 1.0,
        check_timeout_s: float = 1.0,
    ) -> None:
        if not configs:
            raise ValueError("at least one upstream is required")
        self.upstreams = tuple(Upstream(c) for c in configs)
        self._check_interval_s = check_interval_s
        self._check_timeout_s = check_timeout_s
        self._turn = itertools.count()
        self._listeners: list[HealthListener] = []
        self._notifications: set[asyncio.Task[None]] = set()
        self._task: asyncio.Task[None] | None = None
        self._ready = False

    @property
    def ready(self) -> bool:
        """At least one upstream answered ServerReady with true at the last check."""
        return self._ready

    def on_health_change(self, listener: HealthListener) -> None:
        """Call `listener(ready)` whenever the pool's overall readiness flips."""
        self._listeners.append(listener)

    def pick(self) -> Upstream:
        """The healthy upstream with the fewest calls in flight; raises Unavailable if none."""
        upstreams = self.upstreams
        if len(upstreams) == 1:
            only = upstreams[0]
            if only.healthy:
                return only
            raise Unavailable("no healthy Triton upstream", retry_after_s=self._check_interval_s)
        start = next(self._turn) % len(upstreams)
        best: Upstream | None = None
        for i in range(len(upstreams)):
            candidate = upstreams[(start + i) % len(upstreams)]
            if candidate.healthy and (best is None or candidate.in_flight < best.in_flight):
                best = candidate
        if best is None:
            raise Unavailable("no healthy Triton upstream", retry_after_s=self._check_interval_s)
        return best

    def recheck(self, upstream: Upstream) -> None:
        """A call saw UNAVAILABLE from `upstream`: check it now instead of at the next poll."""
        asyncio.get_running_loop().create_task(self._recheck(upstream))

    async def _recheck(self, upstream: Upstream) -> None:
        healthy = await self._is_ready(upstream)
        if healthy != upstream.healthy:
            log.warning("upstream %s (%s) is %s", upstream.name, upstream.url, "ready" if healthy else "NOT ready")
            upstream.healthy = healthy
            self._publish()

    async def start(self) -> None:
        """Check every upstream once (so the gateway starts with a known state), then poll."""
        for upstream in self.upstreams:
            upstream.open()
        await self.check_all()
        self._task = asyncio.create_task(self._poll(), name="upstream-health")

    async def close(self) -> None:
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
            self._task = None
        await asyncio.gather(*(u.channel.close() for u in self.upstreams if u.channel is not None))

    async def check_all(self) -> None:
        results = await asyncio.gather(*(self._is_ready(u) for u in self.upstreams))
        for upstream, healthy in zip(self.upstreams, results, strict=True):
            if healthy != upstream.healthy:
                log.info("upstream %s (%s) is %s", upstream.name, upstream.url, "ready" if healthy else "NOT ready")
            upstream.healthy = healthy
        self._publish()

    async def _is_ready(self, upstream: Upstream) -> bool:
        try:
            raw = await upstream.unary("ServerReady")(_SERVER_READY, timeout=self._check_timeout_s)
        except grpc.aio.AioRpcError:
            return False
        return service_pb2.ServerReadyResponse.FromString(raw).ready

    def _publish(self) -> None:
        ready = any(u.healthy for u in self.upstreams)
        if ready == self._ready:
            return
        self._ready = ready
        for listener in self._listeners:
            # Listeners are async (grpc's health servicer); run them beside the caller,
            # holding each task until it is done (the loop keeps only weak references).
            task = asyncio.get_running_loop().create_task(listener(ready))
            self._notifications.add(task)
            task.add_done_callback(self._notifications.discard)

    async def _poll(self) -> None:
        while True:
            await asyncio.sleep(self._check_interval_s)
            try:
                await self.check_all()
            except Exception:  # a poll must never die: log and keep polling
                log.exception("upstream health check failed")
