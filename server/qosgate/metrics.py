"""Prometheus metrics of the gateway, served on their own HTTP port (default 127.0.0.1:9464).

Label children are cached per label tuple: prometheus_client's `labels()` takes a lock and
builds a key on every call, which the hot path does not need to pay twice per request.
Queue depth, in-flight counts and upstream liveness are not counted by the edge: they are
read from their owners at scrape time, so they cannot drift from the real state.

Label sets are bounded: tenants, classes, codes and upstreams come from the config, and a
model name becomes a label only once it is known to exist (named in the config's
`models`, or served by Triton without error). Any other name a caller sends (a model that
does not exist, or one it may not call) is counted under the model label `_other`, so
callers cannot grow the label sets, and the memory they take, without bound.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterable
from typing import Any, TypeVar

from prometheus_client import CollectorRegistry, Counter, Histogram, start_http_server
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.registry import Collector

from qosgate.scheduler.core import SchedulerSnapshot

OTHER_MODEL = "_other"

_LATENCY_BUCKETS = (
    0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0,
)


_K = TypeVar("_K")


def _summed(items: Iterable[tuple[_K, float]]) -> Iterable[tuple[_K, float]]:
    """Values added up per key: several unknown models count as one `_other`."""
    totals: dict[_K, float] = {}
    for key, value in items:
        totals[key] = totals.get(key, 0) + value
    return totals.items()


class _ScrapeTimeCollector(Collector):
    """Gauges computed when Prometheus scrapes, from the objects that own the state."""

    def __init__(
        self,
        scheduler: Callable[[], SchedulerSnapshot],
        upstreams: Callable[[], Iterable[tuple[str, bool]]],
        model_label: Callable[[str], str],
    ) -> None:
        self._scheduler = scheduler
        self._upstreams = upstreams
        self._model_label = model_label

    def collect(self) -> Iterable[GaugeMetricFamily | CounterMetricFamily]:
        snapshot = self._scheduler()
        label = self._model_label
        depth = GaugeMetricFamily(
            "qosgate_queue_depth",
            "Requests waiting in the gateway's scheduler",
            labels=("model", "class", "tenant"),
        )
        for (model, klass, tenant), count in _summed(
            ((label(m), k, t), n) for (m, k, t), n in snapshot.queued.items()
        ):
            depth.add_metric((model, klass, tenant), count)
        in_flight = GaugeMetricFamily(
            "qosgate_in_flight", "Requests dispatched to Triton and not finished", labels=("model",)
        )
        for model, count in _summed((label(m), n) for m, n in snapshot.in_flight.items()):
            in_flight.add_metric((model,), count)
        window = GaugeMetricFamily(
            "qosgate_dispatch_window",
            "Requests a model may have in flight at Triton (moves with `dispatch_window: auto`)",
            labels=("model",),
        )
        for model, size in snapshot.window.items():
            if label(model) == model:  # windows do not add up: unknown models are left out
                window.add_metric((model,), size)
        served = CounterMetricFamily(
            "qosgate_tenant_service",
            "Cost of the requests a tenant finished, as the fair share counts it: weighted "
            "tokens (prompt + output_token_weight x completion) for LLMs, the model's "
            "cost_unit for other models, requests with fair_share: requests",
            labels=("model", "tenant"),
        )
        for (model, tenant), cost in _summed(
            ((label(m), t), c) for (m, t), c in snapshot.served.items()
        ):
            served.add_metric((model, tenant), cost)
        live = GaugeMetricFamily(
            "qosgate_upstream_live",
            "1 if the upstream answered ServerLive at the last check",
            labels=("upstream",),
        )
        for name, is_live in self._upstreams():
            live.add_metric((name,), 1 if is_live else 0)
        yield from (depth, in_flight, window, served, live)


class GatewayMetrics:
    """The gateway's counters and histograms, in a registry of their own."""

    def __init__(
        self, registry: CollectorRegistry | None = None, *, known_models: Iterable[str] = ()
    ) -> None:
        """`known_models`: model names that are labels from the start (the config's `models`)."""
        self.registry = registry or CollectorRegistry()
        self._known_models = set(known_models)
        self._requests = Counter(
            "qosgate_requests",
            "Requests finished, by model, tenant, class and gRPC status code",
            ("rpc", "model", "tenant", "class", "code"),
            registry=self.registry,
        )
        self._rejections = Counter(
            "qosgate_rejections",
            "Requests the gateway refused itself, by reason (quota, unavailable, deadline, ...)",
            ("reason", "tenant", "class"),
            registry=self.registry,
        )
        self._queue_wait = Histogram(
            "qosgate_queue_wait_seconds",
            "Time a request waited in the gateway's scheduler before dispatch",
            ("class", "tenant"),
            buckets=_LATENCY_BUCKETS,
            registry=self.registry,
        )
        self._upstream_latency = Histogram(
            "qosgate_upstream_latency_seconds",
            "Time from dispatch to Triton until its (last) response",
            ("upstream", "model"),
            buckets=_LATENCY_BUCKETS,
            registry=self.registry,
        )
        self._routed = Counter(
            "qosgate_routed",
            "Calls sent to an upstream, by model, upstream and how it was chosen (least_loaded; "
            "prefix_affinity: affinity, spilled past the load bound, fallback to least loaded)",
            ("model", "upstream", "outcome"),
            registry=self.registry,
        )
        self._failovers = Counter(
            "qosgate_failovers",
            "Calls whose upstream failed before any response (UNAVAILABLE, connection lost), "
            "by model, the upstream that failed and the result: retried on another upstream, "
            "or no_other_upstream (answered UNAVAILABLE)",
            ("model", "upstream", "result"),
            registry=self.registry,
        )
        self._tokens = Counter(
            "qosgate_tokens",
            "LLM tokens the engines counted for finished generations, by model, tenant and "
            "kind (prompt, completion)",
            ("model", "tenant", "kind"),
            registry=self.registry,
        )
        self._children: dict[tuple[Any, ...], Any] = {}

    def _child(self, metric: Any, labels: tuple[str, ...]) -> Any:
        key = (id(metric), *labels)
        child = self._children.get(key)
        if child is None:
            child = self._children[key] = metric.labels(*labels)
        return child

    def watch(
        self,
        scheduler: Callable[[], SchedulerSnapshot],
        upstreams: Callable[[], Iterable[tuple[str, bool]]],
    ) -> None:
        """Export queue depth, in-flight counts and upstream liveness, read at scrape time."""
        self.registry.register(_ScrapeTimeCollector(scheduler, upstreams, self.model_label))

    def model_served(self, model: str) -> None:
        """Triton answered a request for `model` without error: it exists, name it in labels."""
        self._known_models.add(model)

    def model_label(self, model: str) -> str:
        """`model` if it is known to exist, else `_other` (or "" when there is no model)."""
        return model if not model or model in self._known_models else OTHER_MODEL

    def request_done(self, rpc: str, model: str, tenant: str, klass: str, code: str) -> None:
        if code == "OK":
            self.model_served(model)
        self._child(self._requests, (rpc, self.model_label(model), tenant, klass, code)).inc()

    def rejected(self, reason: str, tenant: str, klass: str) -> None:
        self._child(self._rejections, (reason, tenant, klass)).inc()

    def queue_wait(self, klass: str, tenant: str, seconds: float) -> None:
        self._child(self._queue_wait, (klass, tenant)).observe(seconds)

    def upstream_latency(self, upstream: str, model: str, seconds: float) -> None:
        self._child(self._upstream_latency, (upstream, self.model_label(model))).observe(seconds)

    def tokens(self, model: str, tenant: str, prompt: int, completion: int) -> None:
        label = self.model_label(model)
        self._child(self._tokens, (label, tenant, "prompt")).inc(prompt)
        self._child(self._tokens, (label, tenant, "completion")).inc(completion)

    def routed(self, model: str, upstream: str, outcome: str) -> None:
        self._child(self._routed, (self.model_label(model), upstream, outcome)).inc()

    def failover(self, model: str, upstream: str, result: str) -> None:
        self._child(self._failovers, (self.model_label(model), upstream, result)).inc()

    def serve(self, listen: str) -> MetricsEndpoint:
        """Start the /metrics HTTP server on `host:port` (port 0: any free port)."""
        host, _, port = listen.rpartition(":")
        server, thread = start_http_server(int(port), addr=host or "127.0.0.1", registry=self.registry)
        return MetricsEndpoint(server, thread)


class MetricsEndpoint:
    """The running /metrics HTTP server."""

    def __init__(self, server: Any, thread: threading.Thread) -> None:
        self._server = server
        self._thread = thread
        self.port: int = server.server_address[1]

    def stop(self) -> None:
        self._server.shutdown()
        self._server.server_close()
        self._thread.join(timeout=5)
