"""deploy/grafana/qosgate-dashboard.json: loads, and every query names a metric the
gateway exports (so a renamed metric cannot leave a panel silently empty)."""

from __future__ import annotations

import json
import re
from pathlib import Path

from prometheus_client import generate_latest

from qosgate.metrics import GatewayMetrics
from qosgate.scheduler import SchedulerSnapshot

DASHBOARD = Path(__file__).parents[2] / "deploy" / "grafana" / "qosgate-dashboard.json"
METRIC = re.compile(r"\bqosgate_[a-z_]+")


def _exported() -> set[str]:
    """Every sample name the gateway's registry exposes, each metric recorded once."""
    metrics = GatewayMetrics(known_models=["m"])
    metrics.request_done("Generate", "m", "t", "c", "OK")
    metrics.rejected("quota", "t", "c")
    metrics.queue_wait("c", "t", 0.1)
    metrics.upstream_latency("u", "m", 0.1)
    metrics.tokens("m", "t", 1, 1)
    metrics.routed("m", "u", "least_loaded")
    metrics.failover("m", "u", "retried")
    snapshot = SchedulerSnapshot(
        queued={("m", "c", "t"): 1}, in_flight={"m": 1}, window={"m": 4}, served={("m", "t"): 1.0}
    )
    metrics.watch(lambda: snapshot, lambda: [("u", True)])
    text = generate_latest(metrics.registry).decode()
    return {line.split("{")[0].split(" ")[0] for line in text.splitlines() if line.startswith("qosgate_")}


def _queries(node: object) -> list[str]:
    if isinstance(node, dict):
        found = [v for k, v in node.items() if k in ("expr", "definition") and isinstance(v, str)]
        query = node.get("query")
        if isinstance(query, dict) and isinstance(query.get("query"), str):
            found.append(query["query"])
        return found + [q for v in node.values() for q in _queries(v)]
    if isinstance(node, list):
        return [q for v in node for q in _queries(v)]
    return []


def test_every_query_names_an_exported_metric() -> None:
    dashboard = json.loads(DASHBOARD.read_text())
    queries = _queries(dashboard)
    assert len(queries) >= 10
    exported = _exported()
    for query in queries:
        names = METRIC.findall(query)
        assert names, query
        assert set(names) <= exported, (query, set(names) - exported)


def test_panels_cover_tenants_classes_and_models() -> None:
    dashboard = json.loads(DASHBOARD.read_text())
    exprs = " ".join(_queries(dashboard))
    for metric in (
        "qosgate_requests_total",
        "qosgate_rejections_total",
        "qosgate_queue_wait_seconds_bucket",
        "qosgate_in_flight",
        "qosgate_upstream_latency_seconds_bucket",
        "qosgate_tokens_total",
    ):
        assert metric in exprs, metric
    assert {v["name"] for v in dashboard["templating"]["list"]} >= {"tenant", "class", "model"}
