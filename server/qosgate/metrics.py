"""Prometheus metrics of the gateway, served on their own HTTP port (default 127.0.0.1:9464,
`qosgate.metrics_http`).

Counters and histograms keep their values in plain dicts keyed by label tuple, turned into
metric families when Prometheus scrapes: every call updates several of them, and
prometheus_client's own (a lock and a few Python calls per increment, a loop over the
buckets per observation) cost more than the rest of a call's accounting. Updates come from
the event loop's thread only; the scrape thread copies a dict in one step (atomic under the
GIL) and reads the copies. Queue depth, in-flight counts and upstream liveness are not
counted by the edge: they are read from their owners at scrape time, so they cannot drift
from the real state.

Label sets are bounded: tenants, classes, codes and upstreams come from the config, and a
model name becomes a label only once it is known to exist (named in the config's
`models`, or served by Triton without error). Any other name a caller sends (a model that
does not exist, or one it may not call) is counted under the model label `_other`, so
callers cannot grow the label sets, and the memory they take, without bound.
"""

from __future__ import annotations

import bisect
from collections.abc import Callable, Iterable
from typing import TypeVar

from prometheus_client import CollectorRegistry
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily
from prometheus_client.registry import Collector
from prometheus_client.utils import floatToGoString

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
        capped = GaugeMetricFamily(
            "qosgate_class_cap",
            "Requests a class may have in flight where an `auto` window holds it below its "
            "share: its fair-share cap, or its latency-objective cap (absent when neither does)",
            labels=("model", "class"),
        )
        for (model, klass), cap in snapshot.capped.items():
            if label(model) == model:
                capped.add_metric((model, klass), cap)
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
        yield from (depth, in_flight, window, capped, served, live)


class _Counter:
    """A counter family: a value per label tuple."""

    def __init__(self, name: str, documentation: str, labels: tuple[str, ...]) -> None:
        self._name = name
        self._documentation = documentation
        self._labels = labels
        self._values: dict[tuple[str, ...], float] = {}

    def inc(self, labels: tuple[str, ...], amount: float = 1.0) -> None:
        values = self._values
        values[labels] = values.get(labels, 0.0) + amount

    def family(self) -> CounterMetricFamily:
        family = CounterMetricFamily(self._name, self._documentation, labels=self._labels)
        for labels, value in list(self._values.items()):
            family.add_metric(labels, value)
        return family


class _Histogram:
    """A histogram family: per label tuple, the count in each bucket (not cumulative; the
    last one is +Inf) and the sum."""

    def __init__(self, name: str, documentation: str, labels: tuple[str, ...], buckets: tuple[float, ...]) -> None:
        self._name = name
        self._documentation = documentation
        self._labels = labels
        self._bounds = buckets
        self._les = [*(floatToGoString(b) for b in buckets), "+Inf"]
        self._values: dict[tuple[str, ...], list[float]] = {}

    def observe(self, labels: tuple[str, ...], value: float) -> None:
        counts = self._values.get(labels)
        if counts is None:
            counts = self._values[labels] = [0.0] * (len(self._bounds) + 2)
        # A bucket counts the values at most its bound (`le`).
        counts[bisect.bisect_left(self._bounds, value)] += 1
        counts[-1] += value

    def family(self) -> HistogramMetricFamily:
        family = HistogramMetricFamily(self._name, self._documentation, labels=self._labels)
        for labels, counts in list(self._values.items()):
            counts = list(counts)
            cumulative, buckets = 0.0, []
            for le, count in zip(self._les, counts[:-1]):
                cumulative += count
                buckets.append((le, cumulative))
            family.add_metric(labels, buckets, counts[-1])
        return family


class _Families(Collector):
    """Collects the counters and histograms above at scrape time."""

    def __init__(self, families: Iterable[_Counter | _Histogram]) -> None:
        self._families = tuple(families)

    def collect(self) -> Iterable[CounterMetricFamily | HistogramMetricFamily]:
        return [f.family() for f in self._families]


class GatewayMetrics:
    """The gateway's counters and histograms, in a registry of their own."""

    def __init__(
        self, registry: CollectorRegistry | None = None, *, known_models: Iterable[str] = ()
    ) -> None:
        """`known_models`: model names that are labels from the start (the config's `models`)."""
        self.registry = registry or CollectorRegistry()
        self._known_models = set(known_models)
        self._requests = _Counter(
            "qosgate_requests",
            "Requests finished, by model, tenant, class and gRPC status code",
            ("rpc", "model", "tenant", "class", "code"),
        )
        self._rejections = _Counter(
            "qosgate_rejections",
            "Requests the gateway refused itself, by reason (quota, unavailable, deadline, ...)",
            ("reason", "tenant", "class"),
        )
        self._queue_wait = _Histogram(
            "qosgate_queue_wait_seconds",
            "Time a request waited in the gateway's scheduler before dispatch",
            ("class", "tenant"),
            _LATENCY_BUCKETS,
        )
        self._upstream_latency = _Histogram(
            "qosgate_upstream_latency_seconds",
            "Time from dispatch to Triton until its (last) response",
            ("upstream", "model"),
            _LATENCY_BUCKETS,
        )
        self._routed = _Counter(
            "qosgate_routed",
            "Calls sent to an upstream, by model, upstream and how it was chosen (least_loaded; "
            "prefix_affinity: affinity, spilled past the load bound, fallback to least loaded)",
            ("model", "upstream", "outcome"),
        )
        self._failovers = _Counter(
            "qosgate_failovers",
            "Calls whose upstream failed before any response (UNAVAILABLE, connection lost), "
            "by model, the upstream that failed and the result: retried on another upstream, "
            "or no_other_upstream (answered UNAVAILABLE)",
            ("model", "upstream", "result"),
        )
        self._tokens = _Counter(
            "qosgate_tokens",
            "LLM tokens the engines counted for finished generations, by model, tenant and "
            "kind (prompt, completion)",
            ("model", "tenant", "kind"),
        )
        self.registry.register(
            _Families(
                (
                    self._requests,
                    self._rejections,
                    self._queue_wait,
                    self._upstream_latency,
                    self._routed,
                    self._failovers,
                    self._tokens,
                )
            )
        )

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
        self._requests.inc((rpc, self.model_label(model), tenant, klass, code))

    def rejected(self, reason: str, tenant: str, klass: str) -> None:
        self._rejections.inc((reason, tenant, klass))

    def queue_wait(self, klass: str, tenant: str, seconds: float) -> None:
        self._queue_wait.observe((klass, tenant), seconds)

    def upstream_latency(self, upstream: str, model: str, seconds: float) -> None:
        self._upstream_latency.observe((upstream, self.model_label(model)), seconds)

    def tokens(self, model: str, tenant: str, prompt: int, completion: int) -> None:
        label = self.model_label(model)
        self._tokens.inc((label, tenant, "prompt"), prompt)
        self._tokens.inc((label, tenant, "completion"), completion)

    def routed(self, model: str, upstream: str, outcome: str) -> None:
        self._routed.inc((self.model_label(model), upstream, outcome))

    def failover(self, model: str, upstream: str, result: str) -> None:
        self._failovers.inc((self.model_label(model), upstream, result))
