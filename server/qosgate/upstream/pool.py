"""A pool of Triton gRPC endpoints: liveness, per-model readiness, routing, failover.

Every call of every API reaches Triton over each upstream's few persistent HTTP/2
connections (`connections.ConnectionPool`): the relay's KServe calls as frames, the
gateway's own calls (the planes', the health checks) message by message
(upstream/exchange.py). One transport: the health measured is that of the connections the
calls use.

Health has Triton's own two levels. An upstream takes calls while it is *live* (ServerLive);
which models it has *ready* (its RepositoryIndex) only steers a call for a model towards
the upstreams that have it. Triton's ServerReady is not used: with Triton's default strict
readiness it is false while any one model loads or unloads, and reading that as "down"
refused every tenant for as long as one model took to load. A call for a model that no
live upstream has ready still goes to a live one, and Triton answers it as it would
without the gateway (NOT_FOUND for a model that is unloaded or loading): the cached index
is a routing hint that may be a moment old, never a reason to refuse.

An upstream that refuses the connection or answers ServerLive false is not live at once. One
that does not answer within `check_timeout_s` stays live until `SLOW_PROBES_BEFORE_DOWN`
checks in a row went unanswered: a Triton whose CPUs an engine saturates answers late, and
calling it down refused every call it was serving well (and its only upstream, everyone's).

The state is refreshed every `check_interval_s`, and at once when a call saw UNAVAILABLE,
when a repository load or unload went through the gateway (`recheck`), and when one of the
relay's connections to the upstream opens or is lost. A lost connection is reopened at once
and then at most half a second apart, so a restarted Triton is taken back within about half
a second of listening.

Which live upstream gets a call is each model's routing policy (upstream/routing.py: least
loaded, or prefix affinity with bounded loads), and a call's `Route` holds the one
failover policy of every API: a call its upstream failed before the first response (an
UNAVAILABLE status, a refused stream, a lost or missing connection: Triton gone, or the
model not ready there) goes once more to another live upstream, by the same routing;
never after a response has reached the caller, so a client never sees a stream restart or
a token twice.
"""

from __future__ import annotations

import asyncio
import functools
import itertools
import logging
from collections.abc import Callable, Coroutine, Sequence
from typing import Any, Protocol, TypeVar

from google.protobuf.message import DecodeError, Message
from tritonclient.grpc import service_pb2

from qosgate.config import RoutingConfig, UpstreamConfig, UpstreamTlsConfig
from qosgate.errors import Unavailable
from qosgate.kserve.names import path
from qosgate.metrics import GatewayMetrics
from qosgate.scheduler.window import EngineLoad
from qosgate.tls import client_context
from qosgate.transport.peer import Flusher
from qosgate.upstream.connections import ConnectionPool
from qosgate.upstream.routing import Candidate, HashRing, Outcome, PrefixAffinity, least_loaded, routing_key

log = logging.getLogger(__name__)

_SERVER_LIVE = service_pb2.ServerLiveRequest().SerializeToString()
_READY_MODELS = service_pb2.RepositoryIndexRequest(ready=True).SerializeToString()
_SERVER_LIVE_PATH = path("ServerLive")
_REPOSITORY_INDEX_PATH = path("RepositoryIndex")
_DEADLINE_EXCEEDED = 4

# Checks in a row that got no answer in time before a live upstream counts as down.
SLOW_PROBES_BEFORE_DOWN = 3

HealthListener = Callable[[bool], Coroutine[Any, Any, None]]


class Upstream:
    """One Triton endpoint: its HTTP/2 connections, health and load."""

    __slots__ = (
        "name",
        "url",
        "tls",
        "connections",
        "in_flight",
        "live",
        "ready_models",
        "engine_waiting",
        "_probes_started",
        "_probe_applied",
        "slow_probes",
    )

    def __init__(self, config: UpstreamConfig) -> None:
        self.name = config.name
        self.url = config.url
        self.tls: UpstreamTlsConfig | None = config.tls
        # Opened by UpstreamPool.start, inside the event loop that uses them.
        self.connections: ConnectionPool | None = None
        self.in_flight = 0
        self.live = False
        # None: not known (the index could not be read), so any model may be ready here.
        self.ready_models: frozenset[str] | None = frozenset()
        # Requests of each model waiting in this upstream's engine, from its metrics_url.
        self.engine_waiting: dict[str, float] = {}
        # Checks overlap (poll, recheck, reconnect): an older one's answer must not land
        # after a newer one's.
        self._probes_started = 0
        self._probe_applied = 0
        # Checks in a row that got no answer within the check timeout.
        self.slow_probes = 0

    def probe_started(self) -> int:
        """Number a new health probe of this upstream."""
        self._probes_started += 1
        return self._probes_started

    def probe_is_newest(self, probe: int) -> bool:
        """Whether probe `probe`'s answer may land: no later probe's answer has."""
        if probe < self._probe_applied:
            return False
        self._probe_applied = probe
        return True

    def has_ready(self, model: str) -> bool:
        """`model` was ready here at the last check, or this upstream's index is unknown."""
        return self.ready_models is None or model in self.ready_models


class UpstreamObserver(Protocol):
    """What a call's route reports of its attempts at upstreams (the data plane's
    `CallScope` records them: upstream latency, the upstream span)."""

    def upstream_started(self, upstream: str) -> None:
        """An attempt at `upstream` begins (a failover starts a second one)."""

    def responded(self) -> None:
        """A response came from the upstream (every one; the first is what counts)."""

    def upstream_finished(self) -> None:
        """The current attempt ended (last response, failure or cancel)."""


class Route:
    """Where one call goes: the upstream its model's routing chose, counted in that
    upstream's load and reported to the call's observer for each attempt, and the one
    failover policy of every API (see the module): `failover` is asked once the current
    upstream failed the call before its first response, and answers another live
    upstream once, never twice. `done` ends the last attempt."""

    __slots__ = ("_pool", "upstream", "model", "key", "_retried", "_observer", "_done")

    def __init__(
        self, pool: UpstreamPool, upstream: Upstream, model: str | None, key: bytes | None, observer: UpstreamObserver | None
    ) -> None:
        self._pool = pool
        self.upstream = upstream
        self.model = model  # the call's model (None: a call for the server, not a model)
        self.key = key  # what the model's routing chose by (prefix affinity), if anything
        self._retried = False
        self._done = False
        self._observer = observer
        upstream.in_flight += 1
        if observer is not None:
            observer.upstream_started(upstream.name)

    @property
    def can_fail_over(self) -> bool:
        """Whether the pool has another upstream to fail over to at all."""
        return len(self._pool.upstreams) > 1

    def recheck(self) -> None:
        """Check the current upstream now (it failed the call UNAVAILABLE: it may be gone)."""
        self._pool.recheck(self.upstream)

    @property
    def connections(self) -> ConnectionPool:
        """The current upstream's connections (opened by UpstreamPool.start)."""
        connections = self.upstream.connections
        assert connections is not None, "upstream pool not started"
        return connections

    def failover(self) -> ConnectionPool | None:
        """Another live upstream's connections for the call, once (counted, and the failed
        upstream checked at once); None when there is none or the call failed over already."""
        if self._retried or self._done:
            return None
        self._retried = True
        other = self._pool.failover(self.model, self.upstream, key=self.key)
        if other is None:
            return None
        self.done()
        self._done = False
        other.in_flight += 1
        self.upstream = other
        if self._observer is not None:
            self._observer.upstream_started(other.name)
        return other.connections

    def responded(self) -> None:
        """A response came back (before `done`: the first names the model in metrics)."""
        if self._observer is not None:
            self._observer.responded()

    def done(self) -> None:
        """The call is over at its upstream (idempotent)."""
        if self._done:
            return
        self._done = True
        self.upstream.in_flight -= 1
        if self._observer is not None:
            self._observer.upstream_finished()


class UpstreamPool:
    """Live-upstream selection (model ready, then the model's routing policy), failover,
    and the health checks behind them; see the module docstring."""

    def __init__(
        self,
        configs: Sequence[UpstreamConfig],
        *,
        check_interval_s: float = 1.0,
        check_timeout_s: float = 1.0,
        routing: Callable[[str], RoutingConfig] = lambda _model: RoutingConfig(),
        metrics: GatewayMetrics | None = None,
    ) -> None:
        """`routing`: each model's policy; `metrics`: where routing choices and failovers
        are counted."""
        if not configs:
            raise ValueError("at least one upstream is required")
        self.upstreams = tuple(Upstream(c) for c in configs)
        self._by_name = {u.name: u for u in self.upstreams}
        self._ring = HashRing([u.name for u in self.upstreams])
        self._routing = routing
        self._metrics = metrics if metrics is not None else GatewayMetrics()
        self._check_interval_s = check_interval_s
        self._check_timeout_s = check_timeout_s
        self._turn = itertools.count()
        self._listeners: list[HealthListener] = []
        # The loop keeps only weak references to tasks: these hold them until they end.
        self._background: set[asyncio.Task[None]] = set()
        self._tasks: list[asyncio.Task[None]] = []
        self._live = False
        self._closed = False

    @property
    def live(self) -> bool:
        """At least one upstream answered ServerLive with true at its last check."""
        return self._live

    def on_health_change(self, listener: HealthListener) -> None:
        """Call `listener(live)` whenever the pool's overall liveness flips."""
        self._listeners.append(listener)

    def pick(self, model: str | None = None, *, key: bytes | None = None, exclude: Upstream | None = None) -> Upstream:
        """The live upstream for a call (about `model`, if given); raises Unavailable if none.

        Among live upstreams (but `exclude`, one that just failed this call), those with
        `model` ready are the candidates; if none has it ready, every live one is, so that
        Triton gives its own answer. A call with an affinity `key` (see `key`) goes by
        prefix affinity among them; any other to the one with the fewest calls in flight,
        equals taking turns. Load is all calls in flight at an upstream, whatever their
        model: the models of one Triton share its machine.
        """
        upstreams = self.upstreams
        if len(upstreams) == 1 and exclude is None:
            only = upstreams[0]
            if only.live:
                return only
            raise Unavailable("no live Triton upstream", retry_after_s=self._check_interval_s)
        live = [u for u in upstreams if u.live and u is not exclude]
        if model is not None:
            live = [u for u in live if u.has_ready(model)] or live
        if not live:
            raise Unavailable("no live Triton upstream", retry_after_s=self._check_interval_s)
        turn = next(self._turn)
        if model is None:
            return live[least_loaded([Candidate(u.name, u.in_flight) for u in live], turn)]
        candidates = [Candidate(u.name, u.in_flight, u.engine_waiting.get(model)) for u in live]
        if key is None:
            chosen = live[least_loaded(candidates, turn)]
            self._metrics.routed(model, chosen.name, Outcome.LEAST_LOADED.value)
            return chosen
        config = self._routing(model)
        affinity = PrefixAffinity(config.load_factor, config.max_engine_waiting)
        choice = affinity.choose(self._ring, candidates, key, turn)
        chosen = live[choice.index]
        self._metrics.routed(model, chosen.name, choice.outcome.value)
        return chosen

    def key(self, model: str, *, prompt: str | None = None, session: str | None = None) -> bytes | None:
        """The affinity key of a call of `model` under its routing policy (None: none)."""
        return routing_key(self._routing(model), prompt, session)

    def route(self, model: str | None, *, key: bytes | None = None, observer: UpstreamObserver | None = None) -> Route:
        """A call's route: the upstream `pick` chooses (Unavailable if none is live), and
        its one failover (see `Route`)."""
        return Route(self, self.pick(model, key=key), model, key, observer)

    def failover(self, model: str | None, failed: Upstream, *, key: bytes | None) -> Upstream | None:
        """Another live upstream for a call that `failed` failed before its first response
        (Triton down, the connection lost, or the model not ready there), by the model's
        routing; None when there is none. Counted either way, and `failed` checked now."""
        self.recheck(failed)
        label = model or ""
        try:
            other = self.pick(model, key=key, exclude=failed)
        except Unavailable:
            self._metrics.failover(label, failed.name, "no_other_upstream")
            return None
        self._metrics.failover(label, failed.name, "retried")
        log.info("upstream %s failed a %s call before responding: retrying on %s", failed.name, label or "gateway", other.name)
        return other

    def engine_load(self, upstream: str, model: str, load: EngineLoad) -> None:
        """The latest engine reading of `model` at `upstream` (EngineLoadReader)."""
        found = self._by_name.get(upstream)
        if found is not None:
            found.engine_waiting[model] = load.waiting

    def ready_models(self) -> list[str]:
        """Models ready at a live upstream at its last check, sorted; an upstream whose
        index could not be read adds none."""
        return sorted({m for u in self.upstreams if u.live and u.ready_models for m in u.ready_models})

    def recheck(self, upstream: Upstream) -> None:
        """Check `upstream` now instead of at the next poll: a call saw UNAVAILABLE from it,
        or its model repository changed (a load or unload went through the gateway)."""
        self._spawn(self._check(upstream), f"upstream-recheck {upstream.name}")

    async def start(self, flusher: Flusher, *, connections: int = 2) -> None:
        """Open `connections` HTTP/2 connections to each upstream (writing through
        `flusher`, the relay's), check every upstream once over them (so the gateway
        starts with a known state), then poll, and check an upstream again whenever one of
        its connections opens or is lost."""
        for upstream in self.upstreams:
            tls = client_context(upstream.tls) if upstream.tls is not None else None
            pool = upstream.connections = ConnectionPool(flusher, upstream.url, size=connections, tls=tls)
            await pool.start()
            pool.watch(functools.partial(self.recheck, upstream))
        await self.check_all()
        self._tasks.append(asyncio.create_task(self._poll(), name="upstream-health"))

    async def close(self) -> None:
        # From here on nothing new is spawned: a recheck asked by a call failing as the
        # connections close would start a check, then a health listener, on a loop about
        # to stop (a coroutine never awaited).
        self._closed = True
        tasks = [*self._tasks, *self._background]
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        self._tasks.clear()
        for upstream in self.upstreams:
            if upstream.connections is not None:
                await upstream.connections.stop()

    async def check_all(self) -> None:
        await asyncio.gather(*(self._check(u) for u in self.upstreams))

    async def _check(self, upstream: Upstream) -> None:
        """Ask `upstream` whether it is live and which models it has ready; publish changes."""
        probe = upstream.probe_started()
        answer = await self._probe(upstream)
        if not upstream.probe_is_newest(probe):
            return
        if answer is None:  # no answer in time: busy, or hung; down only if it lasts
            upstream.slow_probes += 1
            if upstream.slow_probes < SLOW_PROBES_BEFORE_DOWN:
                return
            answer = False, frozenset()
        else:
            upstream.slow_probes = 0
        live, ready_models = answer
        if live != upstream.live:
            level = logging.INFO if live else logging.WARNING
            state = "live" if live else "NOT live"
            log.log(level, "upstream %s (%s) is %s", upstream.name, upstream.url, state)
        if ready_models != upstream.ready_models and live:
            log.info(
                "upstream %s models ready: %s",
                upstream.name,
                "unknown" if ready_models is None else ", ".join(sorted(ready_models)) or "none",
            )
        upstream.live, upstream.ready_models = live, ready_models
        self._publish()

    async def _probe(self, upstream: Upstream) -> tuple[bool, frozenset[str] | None] | None:
        """(live, ready models) as `upstream` answers them; None if it did not answer in time."""
        connections = upstream.connections
        if connections is None:
            return False, frozenset()
        status, raw = await connections.unary(_SERVER_LIVE_PATH, _SERVER_LIVE, self._check_timeout_s)
        if status == _DEADLINE_EXCEEDED:
            return None
        live = None if raw is None else _parsed(service_pb2.ServerLiveResponse, raw)
        if live is None or not live.live:
            return False, frozenset()
        status, raw = await connections.unary(_REPOSITORY_INDEX_PATH, _READY_MODELS, self._check_timeout_s)
        if status == _DEADLINE_EXCEEDED:
            return True, upstream.ready_models  # live and slow: keep the last index
        index = None if raw is None else _parsed(service_pb2.RepositoryIndexResponse, raw)
        if index is None:
            # Live but the index is not for us (e.g. Triton's restricted repository
            # protocol): route without the hint rather than call the upstream down.
            return True, None
        return True, frozenset(m.name for m in index.models)

    def _publish(self) -> None:
        live = any(u.live for u in self.upstreams)
        if live == self._live:
            return
        self._live = live
        for listener in self._listeners:
            # Listeners are async (grpc's health servicer): run them beside the caller.
            self._spawn(listener(live), "upstream-health-listener")

    def _spawn(self, coro: Coroutine[Any, Any, None], name: str) -> None:
        if self._closed:
            coro.close()
            return
        task = asyncio.get_running_loop().create_task(coro, name=name)
        self._background.add(task)
        task.add_done_callback(self._background.discard)

    async def _poll(self) -> None:
        while True:
            await asyncio.sleep(self._check_interval_s)
            try:
                await self.check_all()
            except Exception:  # a poll must never die: log and keep polling
                log.exception("upstream health check failed")


M = TypeVar("M", bound=Message)


def _parsed(message_type: type[M], raw: bytes) -> M | None:
    """An upstream's answer parsed; None when it is not one (a server that is not Triton)."""
    try:
        return message_type.FromString(raw)
    except DecodeError:
        return None
