"""deploy/grafana: the dashboard loads, and every query of it and of the alert rules names
a metric the gateway exports (so a renamed metric cannot leave a panel empty or an alert
silent); the ServiceMonitor scrapes the gateway Service's metrics port (rendered with
kustomize, next to deploy/kubernetes)."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
from kustomize import render
from prometheus_client import generate_latest

from qosgate.metrics import GatewayMetrics
from qosgate.scheduler import SchedulerSnapshot

DEPLOY = Path(__file__).parents[2] / "deploy"
DASHBOARD = DEPLOY / "grafana" / "qosgate-dashboard.json"
MONITORING = render(DEPLOY / "grafana")
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
        queued={("m", "c", "t"): 1}, in_flight={"m": 1}, window={"m": 4}, served={("m", "t"): 1.0},
        capped={("m", "c"): 2},
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


def _monitoring(kind: str) -> dict:
    (found,) = [m for m in MONITORING if m["kind"] == kind]
    return found


def test_service_monitor_scrapes_the_gateway_services_metrics_port() -> None:
    (service,) = [m for m in render(DEPLOY / "kubernetes") if m["kind"] == "Service" and m["metadata"]["name"] == "qosgate"]
    monitor = _monitoring("ServiceMonitor")
    assert monitor["apiVersion"] == "monitoring.coreos.com/v1"
    assert monitor["metadata"]["namespace"] == service["metadata"]["namespace"]
    assert monitor["spec"]["selector"]["matchLabels"].items() <= service["metadata"]["labels"].items()
    (endpoint,) = monitor["spec"]["endpoints"]
    assert endpoint["port"] in {p["name"] for p in service["spec"]["ports"]}
    assert endpoint["path"] == "/metrics"


def _rules() -> list[dict]:
    return [rule for group in _monitoring("PrometheusRule")["spec"]["groups"] for rule in group["rules"]]


@pytest.mark.parametrize("rule", _rules(), ids=lambda rule: rule["alert"])
def test_alert_rule_is_well_formed_over_exported_metrics(rule: dict) -> None:
    expr = rule["expr"]
    names = METRIC.findall(expr)
    assert names and set(names) <= _exported(), (expr, set(names) - _exported())
    assert expr.count("(") == expr.count(")") and expr.count("[") == expr.count("]")
    assert re.fullmatch(r"\d+[smh]", rule.get("for", "0s"))
    assert rule["labels"]["severity"] in ("critical", "warning")
    assert rule["annotations"]["summary"]


def test_alerts_cover_the_gateways_failure_modes() -> None:
    exprs = " ".join(rule["expr"] for rule in _rules())
    for metric in ("qosgate_upstream_live", "qosgate_rejections_total", "qosgate_requests_total",
                   "qosgate_queue_wait_seconds_bucket"):
        assert metric in exprs, metric
