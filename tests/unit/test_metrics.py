"""The gateway's counters and histograms scrape as prometheus_client's own would."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest

from qosgate.metrics import _LATENCY_BUCKETS, GatewayMetrics

# On a bound (a bucket counts values up to and including its `le`), between bounds, zero,
# past the last bound.
SECONDS = (0.0, 0.0005, 0.0007, 0.001, 0.003, 0.25, 59.0, 60.0, 61.5, 0.0005)


def _samples(registry: CollectorRegistry, prefix: str) -> list[str]:
    """Exposition lines of the families named `prefix...`, without `_created` samples."""
    lines = generate_latest(registry).decode().splitlines()
    return sorted(line for line in lines if line.startswith(prefix) and "_created" not in line)


def test_histogram_buckets_count_and_sum_match_prometheus_client() -> None:
    ours = GatewayMetrics()
    registry = CollectorRegistry()
    reference = Histogram(
        "qosgate_queue_wait_seconds", "", ("class", "tenant"), buckets=_LATENCY_BUCKETS, registry=registry
    )
    for i, seconds in enumerate(SECONDS):
        tenant = "a" if i % 3 else "b"
        ours.queue_wait("standard", tenant, seconds)
        reference.labels("standard", tenant).observe(seconds)
    expected = _samples(registry, "qosgate_queue_wait_seconds")
    assert len(expected) == 2 * (len(_LATENCY_BUCKETS) + 3)  # buckets, +Inf, count, sum per tenant
    assert _samples(ours.registry, "qosgate_queue_wait_seconds") == expected


def test_counters_match_prometheus_client() -> None:
    ours = GatewayMetrics(known_models=["m"])
    registry = CollectorRegistry()
    requests = Counter("qosgate_requests", "", ("rpc", "model", "tenant", "class", "code"), registry=registry)
    tokens = Counter("qosgate_tokens", "", ("model", "tenant", "kind"), registry=registry)
    for code in ("OK", "OK", "RESOURCE_EXHAUSTED"):
        ours.request_done("ModelInfer", "m", "t", "standard", code)
        requests.labels("ModelInfer", "m", "t", "standard", code).inc()
    ours.request_done("ModelInfer", "nope", "t", "standard", "NOT_FOUND")  # unknown: `_other`
    requests.labels("ModelInfer", "_other", "t", "standard", "NOT_FOUND").inc()
    ours.tokens("m", "t", 12, 30)
    tokens.labels("m", "t", "prompt").inc(12)
    tokens.labels("m", "t", "completion").inc(30)
    for prefix in ("qosgate_requests", "qosgate_tokens"):
        assert _samples(ours.registry, prefix) == _samples(registry, prefix), prefix
