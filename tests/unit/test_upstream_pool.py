"""Which upstream gets a call, and how the pool learns each one's health.

Choice: live upstreams only; for a model, those that have it ready first; then the fewest
in flight, round-robin among equals, or prefix affinity by the model's routing; failover
once to another upstream. Health: ServerLive and the ready models of the
repository index, checked against an in-process fake Triton (a grpcio server) over the
relay's HTTP/2 connections, as the gateway checks them.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import socket
from collections.abc import AsyncIterator

import grpc
import pytest
from tritonclient.grpc import service_pb2, service_pb2_grpc

from qosgate.config import RoutingConfig, UpstreamConfig
from qosgate.errors import Unavailable
from qosgate.metrics import GatewayMetrics
from qosgate.transport.peer import Flusher
from qosgate.transport import http2
from qosgate.upstream.connections import SPILL_STREAMS, SPILL_WINDOW, UpstreamConnection, has_room
from qosgate.upstream.connections import ConnectionPool as Connections
from qosgate.scheduler.window import EngineLoad
from qosgate.upstream import UpstreamPool
from qosgate.upstream.pool import SLOW_PROBES_BEFORE_DOWN
from tests.fakes import until


def pool_of(*names: str) -> UpstreamPool:
    return UpstreamPool([UpstreamConfig(name=n, url=f"127.0.0.1:{i + 1}") for i, n in enumerate(names)])


def test_no_live_upstream_is_unavailable_with_a_retry_hint() -> None:
    pool = pool_of("a", "b")
    with pytest.raises(Unavailable) as caught:
        pool.pick()
    assert caught.value.retry_after_s is not None


def test_only_live_upstreams_are_picked() -> None:
    pool = pool_of("a", "b", "c")
    pool.upstreams[1].live = True
    assert {pool.pick().name for _ in range(6)} == {"b"}
    assert {pool.pick("m").name for _ in range(6)} == {"b"}


def test_equals_take_turns() -> None:
    pool = pool_of("a", "b", "c")
    for upstream in pool.upstreams:
        upstream.live = True
    assert [pool.pick().name for _ in range(6)] == ["a", "b", "c", "a", "b", "c"]


def test_least_loaded_wins() -> None:
    pool = pool_of("a", "b", "c")
    for upstream in pool.upstreams:
        upstream.live = True
    a, b, _ = pool.upstreams
    # A route counts its call at its upstream until done.
    routes = [pool.route(None) for _ in range(3)]
    assert [route.upstream.name for route in routes] == ["a", "b", "c"]
    routes[2].done()
    routes[2].done()  # once only
    a.in_flight += 1  # a has two now, b one
    assert {pool.pick().name for _ in range(6)} == {"c"}
    for route in routes[:2]:
        route.done()
    assert (a.in_flight, b.in_flight) == (1, 0)


def test_an_upstream_with_the_model_ready_wins_over_a_less_loaded_one() -> None:
    pool = pool_of("a", "b", "c")
    a, b, c = pool.upstreams
    for upstream in pool.upstreams:
        upstream.live = True
    a.ready_models = frozenset({"m", "n"})
    b.ready_models = frozenset({"n"})  # m is loading or unloaded there
    c.ready_models = frozenset({"m"})
    a.in_flight, c.in_flight = 2, 1  # calls of any model at each
    assert {pool.pick("m").name for _ in range(6)} == {"c"}
    assert {pool.pick("n").name for _ in range(6)} == {"b"}
    assert {pool.pick().name for _ in range(6)} == {"b"}  # no model: load alone


def test_an_unknown_index_counts_as_ready() -> None:
    pool = pool_of("a", "b")
    a, b = pool.upstreams
    a.live = b.live = True
    a.ready_models = frozenset()
    b.ready_models = None  # the index could not be read there
    assert {pool.pick("m").name for _ in range(4)} == {"b"}


def test_a_model_ready_nowhere_still_goes_to_a_live_upstream_for_tritons_answer() -> None:
    pool = pool_of("a", "b")
    a, b = pool.upstreams
    a.live = b.live = True
    a.ready_models = b.ready_models = frozenset({"other"})
    a.in_flight = 1
    assert {pool.pick("unloaded").name for _ in range(4)} == {"b"}


def test_ready_models_are_those_of_live_upstreams() -> None:
    pool = pool_of("a", "b", "c")
    a, b, c = pool.upstreams
    a.live = b.live = True
    a.ready_models = frozenset({"m"})
    b.ready_models = None  # unknown: lists nothing
    c.ready_models = frozenset({"dead"})  # not live
    assert pool.ready_models() == ["m"]
    c.live = True
    assert pool.ready_models() == ["dead", "m"]


def test_an_older_probe_never_overwrites_a_newer_ones_answer() -> None:
    upstream = pool_of("a").upstreams[0]
    slow, fast = upstream.probe_started(), upstream.probe_started()
    assert upstream.probe_is_newest(fast)
    assert not upstream.probe_is_newest(slow)
    assert upstream.probe_is_newest(upstream.probe_started())


class LoadingTriton(service_pb2_grpc.GRPCInferenceServiceServicer):
    """Triton while one model loads: live, not ready (strict readiness), `ready` indexed."""

    def __init__(self, ready: set[str]) -> None:
        self.ready = ready

    async def ServerLive(self, request, context):  # noqa: N802 - the RPC's name
        return service_pb2.ServerLiveResponse(live=True)

    async def ServerReady(self, request, context):  # noqa: N802
        return service_pb2.ServerReadyResponse(ready=False)

    async def RepositoryIndex(self, request, context):  # noqa: N802
        assert request.ready, "the pool asks for ready models only"
        response = service_pb2.RepositoryIndexResponse()
        for name in sorted(self.ready):
            response.models.add(name=name, version="1", state="READY")
        return response


class LiveOnlyTriton(service_pb2_grpc.GRPCInferenceServiceServicer):
    """A Triton whose repository API is closed to the gateway (restricted protocol)."""

    async def ServerLive(self, request, context):  # noqa: N802
        return service_pb2.ServerLiveResponse(live=True)


@contextlib.asynccontextmanager
async def fake_triton(
    servicer: service_pb2_grpc.GRPCInferenceServiceServicer, port: int = 0
) -> AsyncIterator[int]:
    server = grpc.aio.server()
    service_pb2_grpc.add_GRPCInferenceServiceServicer_to_server(servicer, server)
    port = server.add_insecure_port(f"127.0.0.1:{port}")
    await server.start()
    try:
        yield port
    finally:
        await server.stop(None)


class BusyTriton(LoadingTriton):
    """A Triton whose ServerLive answers `live`, later than any check timeout while `slow`."""

    def __init__(self) -> None:
        super().__init__({"identity"})
        self.live = True
        self.slow = False

    async def ServerLive(self, request, context):  # noqa: N802
        if self.slow:
            await asyncio.sleep(1.0)
        return service_pb2.ServerLiveResponse(live=self.live)


@contextlib.asynccontextmanager
async def started(port: int, check_interval_s: float, check_timeout_s: float = 1.0) -> AsyncIterator[UpstreamPool]:
    config = UpstreamConfig(name="t", url=f"127.0.0.1:{port}")
    pool = UpstreamPool([config], check_interval_s=check_interval_s, check_timeout_s=check_timeout_s)
    await pool.start(Flusher())
    try:
        yield pool
    finally:
        await pool.close()



async def test_a_loading_model_leaves_the_upstream_live_and_the_others_ready() -> None:
    """Regression: ServerReady false while one model loads took every model out of service."""
    triton = LoadingTriton({"minilm"})
    async with fake_triton(triton) as port, started(port, check_interval_s=0.05) as pool:
        assert pool.live
        upstream = pool.upstreams[0]
        assert upstream.ready_models == {"minilm"}
        assert pool.pick("minilm") is upstream
        assert pool.pick("identity") is upstream  # Triton itself answers for it
        triton.ready.add("identity")  # its load finished
        await until(lambda: upstream.has_ready("identity"))


async def test_a_repository_change_is_seen_at_once_on_recheck() -> None:
    triton = LoadingTriton({"identity"})
    async with fake_triton(triton) as port, started(port, check_interval_s=3600) as pool:
        upstream = pool.upstreams[0]
        triton.ready.discard("identity")  # unloaded; the next poll is an hour away
        pool.recheck(upstream)
        await until(lambda: not upstream.has_ready("identity"))
        assert pool.live


async def test_a_closed_pool_starts_no_check() -> None:
    """Regression: a recheck asked while the gateway stopped (a call failing as the
    connections closed) spawned a check, then a health listener, on a loop about to stop."""
    async with fake_triton(LoadingTriton({"identity"})) as port, started(port, check_interval_s=3600) as pool:
        pass
    pool.recheck(pool.upstreams[0])
    assert not [t for t in asyncio.all_tasks() if t.get_name().startswith("upstream-")]


async def test_an_unreadable_index_keeps_the_upstream_live_without_the_hint() -> None:
    async with fake_triton(LiveOnlyTriton()) as port, started(port, check_interval_s=3600) as pool:
        assert pool.live
        assert pool.upstreams[0].ready_models is None
        assert pool.pick("anything") is pool.upstreams[0]


async def test_a_restarted_upstream_is_live_again_without_waiting_for_a_poll() -> None:
    """The relay's connections drive the checks: the hourly poll never runs here."""
    changes: list[bool] = []

    async def listener(live: bool) -> None:
        changes.append(live)

    triton = LoadingTriton({"identity"})
    server = grpc.aio.server()
    service_pb2_grpc.add_GRPCInferenceServiceServicer_to_server(triton, server)
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    async with started(port, check_interval_s=3600) as pool:
        pool.on_health_change(listener)
        assert pool.live
        await server.stop(None)  # Triton goes away
        await until(lambda: changes == [False])
        with pytest.raises(Unavailable):
            pool.pick("identity")
        async with fake_triton(triton, port):  # and comes back on the same port
            await until(lambda: changes == [False, True])
            assert pool.pick("identity") is pool.upstreams[0]


async def test_a_connection_refused_for_a_while_is_one_warning_and_reopens_by_itself(
    caplog: pytest.LogCaptureFixture,
) -> None:
    with socket.socket() as closed:  # a port nothing listens on, yet
        closed.bind(("127.0.0.1", 0))
        port = closed.getsockname()[1]
    caplog.set_level(logging.INFO, "qosgate.upstream.connections")
    connections = Connections(Flusher(), f"127.0.0.1:{port}")
    opened: list[bool] = []
    connections.watch(lambda: opened.append(True))
    await connections.start()
    try:
        assert connections.pick() is None
        await asyncio.sleep(1.5)  # attempts 0.05, 0.2 and then 0.5 s apart, all refused
        assert not opened
        async with fake_triton(LiveOnlyTriton(), port):  # no call asks for it: it reopens anyway
            await until(lambda: opened)
            assert connections.pick() is not None
            await connections.stop()  # before the server goes: that would be an outage of its own
    finally:
        await connections.stop()
    records = [(r.levelno, r.getMessage()) for r in caplog.records if r.name == "qosgate.upstream.connections"]
    assert [level for level, _ in records] == [logging.WARNING, logging.INFO], records
    assert "failed attempts" in records[1][1]


async def test_a_slow_answer_is_not_down_until_it_lasts() -> None:
    """Regression: one ServerLive answered late while vLLM saturated the CPUs took the only
    upstream out of service, and every call in flight was refused."""
    triton = BusyTriton()
    async with fake_triton(triton) as port, started(port, check_interval_s=3600, check_timeout_s=0.1) as pool:
        upstream = pool.upstreams[0]
        triton.slow = True
        for _ in range(SLOW_PROBES_BEFORE_DOWN - 1):
            await pool.check_all()
            assert pool.live and upstream.has_ready("identity")
            assert pool.pick("identity") is upstream
        triton.slow = False
        await pool.check_all()  # an answer in time starts the count again
        triton.slow = True
        for _ in range(SLOW_PROBES_BEFORE_DOWN - 1):
            await pool.check_all()
        assert pool.live
        await pool.check_all()
        assert not pool.live
        with pytest.raises(Unavailable):
            pool.pick("identity")
        triton.slow = False
        await pool.check_all()
        assert pool.live and pool.pick("identity") is upstream


async def test_a_live_false_answer_is_down_at_once() -> None:
    triton = BusyTriton()
    async with fake_triton(triton) as port, started(port, check_interval_s=3600) as pool:
        assert pool.live
        triton.live = False
        await pool.check_all()
        assert not pool.live


def affinity_pool(*names: str, metrics: GatewayMetrics | None = None, **routing: object) -> UpstreamPool:
    config = RoutingConfig.model_validate({"policy": "prefix_affinity", **routing})
    pool = UpstreamPool(
        [UpstreamConfig(name=n, url=f"127.0.0.1:{i + 1}") for i, n in enumerate(names)],
        routing=lambda _model: config,
        metrics=metrics,
    )
    for upstream in pool.upstreams:
        upstream.live = True
    return pool


def test_calls_with_one_prefix_go_to_one_upstream() -> None:
    metrics = GatewayMetrics(known_models=["llm"])
    pool = affinity_pool("a", "b", "c", metrics=metrics, prefix_bytes=16)
    key = pool.key("llm", prompt="You are the assistant of acme. " + "question")
    assert key == pool.key("llm", prompt="You are the assistant of acme. " + "another one")
    chosen = {pool.pick("llm", key=key).name for _ in range(5)}
    assert len(chosen) == 1
    upstream = next(u for u in pool.upstreams if u.name in chosen)
    assert metrics.registry.get_sample_value(
        "qosgate_routed_total", {"model": "llm", "upstream": upstream.name, "outcome": "affinity"}
    ) == 5


def test_least_loaded_models_get_no_key() -> None:
    pool = pool_of("a", "b")
    assert pool.key("llm", prompt="anything", session="s") is None
    assert affinity_pool("a").key("identity") is None  # neither a prompt nor a session


def test_the_session_header_keys_calls_of_one_session_together() -> None:
    pool = affinity_pool("a", "b", "c", session_header="X-Session")
    key = pool.key("llm", prompt="p1", session="s-1")
    assert key == pool.key("llm", prompt="p2", session="s-1")


def test_a_saturated_engine_is_passed_over() -> None:
    pool = affinity_pool("a", "b", max_engine_waiting=2)
    key = pool.key("llm", prompt="prefix")
    first = pool.pick("llm", key=key)
    pool.engine_load(first.name, "llm", EngineLoad(waiting=5, kv_cache_usage=None))
    assert pool.pick("llm", key=key) is not first


def test_by_default_a_hot_prefix_leaves_a_replica_whose_engine_queues() -> None:
    """On two replicas the default load bound never binds: the engine's queue does."""
    pool = affinity_pool("a", "b")
    key = pool.key("llm", prompt="one system prompt for every call")
    first = pool.pick("llm", key=key)
    for _ in range(20):  # all of them in flight on its replica: the load bound lets them
        assert pool.pick("llm", key=key) is first
        first.in_flight += 1
    pool.engine_load(first.name, "llm", EngineLoad(waiting=4, kv_cache_usage=None))
    assert pool.pick("llm", key=key) is first  # a few waiting between steps: not saturated
    pool.engine_load(first.name, "llm", EngineLoad(waiting=5, kv_cache_usage=None))
    assert pool.pick("llm", key=key) is not first
    # Turned off, engine queues are ignored.
    off = affinity_pool("a", "b", max_engine_waiting=None)
    chosen = off.pick("llm", key=key)
    off.engine_load(chosen.name, "llm", EngineLoad(waiting=50, kv_cache_usage=None))
    assert off.pick("llm", key=key) is chosen


async def test_a_route_fails_over_to_another_upstream_once() -> None:
    metrics = GatewayMetrics(known_models=["llm"])
    pool = affinity_pool("a", "b", metrics=metrics)
    await pool.start(Flusher())  # the failed one is rechecked (and found down: nothing listens)
    try:
        a, b = pool.upstreams
        a.live = b.live = True
        route = pool.route("llm", key=b"k")
        first = route.upstream
        other = b if first is a else a
        assert first.in_flight == 1
        assert route.failover() is other.connections
        assert route.upstream is other and (first.in_flight, other.in_flight) == (0, 1)
        assert route.failover() is None  # once
        route.done()
        assert other.in_flight == 0
        a.live, b.live = True, False
        assert pool.route("llm").failover() is None  # nowhere else to go
        counted = {
            result: metrics.registry.get_sample_value(
                "qosgate_failovers_total", {"model": "llm", "upstream": "a", "result": result}
            )
            for result in ("retried", "no_other_upstream")
        }
        assert counted == {"retried": 1, "no_other_upstream": 1}
    finally:
        await pool.close()


def test_a_connection_has_room_below_both_marks() -> None:
    assert has_room(0, 4 << 20)  # idle, Triton's window
    assert has_room(SPILL_STREAMS - 1, SPILL_WINDOW + 1)
    assert not has_room(SPILL_STREAMS, 4 << 20)  # enough calls share it
    assert not has_room(0, SPILL_WINDOW)  # large messages in flight hold its window


async def _open(flusher: Flusher, ends: list[socket.socket]) -> UpstreamConnection:
    """A relay connection over a socket pair to a server end of the test's own (the relay's
    HTTP/2 code in the server role), once it has taken the server's settings and window."""
    loop = asyncio.get_running_loop()
    near, far = socket.socketpair()
    far.setblocking(False)
    ends += (near, far)
    _, conn = await loop.create_connection(lambda: UpstreamConnection(flusher, "test"), sock=near)
    server = http2.Http2Connection(server=True, max_concurrent_streams=1000)
    server.feed(await loop.sock_recv(far, 1 << 16))  # preface, settings, window
    await loop.sock_sendall(far, server.outgoing())
    await until(lambda: conn.h2.send_window > SPILL_WINDOW)
    return conn


async def test_calls_fill_one_connection_before_the_next() -> None:
    """Calls that leave together share one connection's reads and writes; the next one
    takes calls once the first has no room (`has_room`)."""
    flusher, ends = Flusher(), []
    connections = Connections(flusher, "127.0.0.1:1", size=2)
    try:
        first, second = await _open(flusher, ends), await _open(flusher, ends)
        connections._connections = [first, second]
        assert connections.pick() is first
        first.streams = dict.fromkeys(range(SPILL_STREAMS - 1))
        assert connections.pick() is first
        first.streams = dict.fromkeys(range(SPILL_STREAMS))
        assert connections.pick() is second
        # Both past the mark: the one with fewer streams.
        second.streams = dict.fromkeys(range(SPILL_STREAMS + 5))
        assert connections.pick() is first
        first.went_away = True  # the server's GOAWAY: no new streams there
        assert connections.pick() is second
    finally:
        for end in ends:
            end.close()
