"""A relay (qosgate.relay) for integration tests, on its own uvloop thread.

KServe paths go to a real Triton through the given policy; every other path goes to an
in-process grpcio server on a unix socket (here serving grpc.health.v1), as the gateway's
own services would.
"""

from __future__ import annotations

import asyncio
import pathlib
import tempfile
import threading
from collections.abc import Coroutine
from typing import Any, TypeVar

import grpc
import uvloop
from grpc_health.v1 import health, health_pb2, health_pb2_grpc

from qosgate.relay.policy import CallPolicy
from qosgate.relay.server import Relay

T = TypeVar("T")
KSERVE = b"/inference.GRPCInferenceService/"


class RelayThread:
    """A started relay in front of `triton_url`; `url` is where clients connect."""

    def __init__(
        self,
        triton_url: str,
        policy: CallPolicy,
        *,
        max_message_size: int = 64 << 20,
        max_response_size: int = 1 << 32,
        max_connection_pending: int = 256 << 20,
    ) -> None:
        self._triton_url = triton_url
        self._policy = policy
        self._max_message_size = max_message_size
        self._max_response_size = max_response_size
        self._max_connection_pending = max_connection_pending
        self._dir = tempfile.TemporaryDirectory(prefix="qosgate-relay-")
        self.loop = uvloop.new_event_loop()
        self._thread = threading.Thread(target=self.loop.run_forever, name="relay", daemon=True)
        self.relay: Relay | None = None
        self._local: grpc.aio.Server | None = None
        self.port = 0

    def run(self, coro: Coroutine[Any, Any, T], timeout: float = 30.0) -> T:
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(timeout)

    async def _start(self) -> None:
        socket = pathlib.Path(self._dir.name) / "local.sock"
        self._local = grpc.aio.server()
        servicer = health.aio.HealthServicer()
        await servicer.set("", health_pb2.HealthCheckResponse.SERVING)
        health_pb2_grpc.add_HealthServicer_to_server(servicer, self._local)
        self._local.add_insecure_port(f"unix:{socket}")
        await self._local.start()
        relay = self.relay = Relay(
            max_message_size=self._max_message_size, max_connection_pending=self._max_connection_pending
        )
        triton = relay.upstream(self._triton_url)
        local = relay.upstream(f"unix:{socket}", connections=1)
        await triton.start()
        await local.start()
        relay.route(KSERVE, triton, self._policy, max_response_size=self._max_response_size)
        relay.route(b"/", local)
        self.port = await relay.listen("127.0.0.1", 0)

    async def _stop(self) -> None:
        if self.relay is not None:
            await self.relay.close()
        if self._local is not None:
            await self._local.stop(0)

    @property
    def url(self) -> str:
        return f"127.0.0.1:{self.port}"

    def __enter__(self) -> RelayThread:
        self._thread.start()
        self.run(self._start())
        return self

    def __exit__(self, *exc: object) -> None:
        try:
            self.run(self._stop())
        finally:
            self.loop.call_soon_threadsafe(self.loop.stop)
            self._thread.join(timeout=10)
            self.loop.close()
            self._dir.cleanup()
