"""DataPlane's CallScope: one place where every call is admitted, released, counted and
traced, however it ends."""

from __future__ import annotations

import asyncio

import pytest
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

from qosgate.config import TracingConfig, parse_config
from qosgate.dataplane.plane import CallCost, DataPlane
from qosgate.dataplane.tracing import Tracing
from qosgate.errors import InvalidArgument, QuotaExceeded
from tests.fakes import FakeClock, make_dataplane, recording_tracing

CONFIG = parse_config(
    {
        "models": {"m": {"dispatch_window": 1}},
        "tenants": [
            {"name": "acme", "api_keys": [{"key": "k"}], "max_class": "critical"},
            {"name": "one", "api_keys": [{"key": "k1"}], "limits": {"requests_per_second": 0.001, "burst": 1}},
            {"name": "meter", "api_keys": [{"key": "k2"}], "limits": {"tokens_per_minute": 1000}},
        ],
    },
    source="<test>",
)
TRACE_ID = "4bf92f3577b34da6a3ce929d0e0e4736"
TRACEPARENT = f"00-{TRACE_ID}-00f067aa0ba902b7-01"


def _plane() -> DataPlane:
    return make_dataplane(CONFIG, FakeClock())  # type: ignore[no-any-return]


def _traced_plane() -> tuple[DataPlane, InMemorySpanExporter]:
    tracing, spans = recording_tracing()
    return make_dataplane(CONFIG, FakeClock(), tracing=tracing), spans


def _count(plane: DataPlane, name: str, **labels: str) -> float:
    return plane.metrics.registry.get_sample_value(name, labels) or 0.0


async def _served(plane: DataPlane, tenant_key: str = "k", headers: dict[str, str] | None = None) -> list[tuple[str, str]]:
    """One call that reaches the upstream; returns the headers it sent there."""
    tenant = plane.directory.identify([("x-api-key", tenant_key)])
    async with plane.open("Generate", tenant, "m", headers) as scope:
        await scope.admit(CallCost(), priority_class=None, deadline=None)
        scope.upstream_started("u1")
        sent = list(scope.upstream_headers())
        scope.responded()
        scope.upstream_finished()
    return sent


async def test_a_served_call_is_counted_timed_and_traced_under_the_callers_trace() -> None:
    plane, exporter = _traced_plane()
    sent = await _served(plane, headers={"traceparent": TRACEPARENT})
    labels = {"rpc": "Generate", "model": "m", "tenant": "acme", "class": "standard"}
    assert _count(plane, "qosgate_requests_total", **labels, code="OK") == 1
    assert _count(plane, "qosgate_upstream_latency_seconds_count", upstream="u1", model="m") == 1
    assert _count(plane, "qosgate_queue_wait_seconds_count", **{"class": "standard", "tenant": "acme"}) == 1
    spans = {s.name: s for s in exporter.get_finished_spans()}
    call = spans["qosgate Generate"]
    assert format(call.context.trace_id, "032x") == TRACE_ID
    assert call.attributes["qosgate.class"] == "standard" and call.attributes["qosgate.code"] == "OK"
    for child in ("queue", "upstream", "first_token"):
        assert spans[child].parent.span_id == call.context.span_id, child
    # Triton gets the upstream span as the parent of whatever it traces.
    (traceparent,) = [v for k, v in sent if k == "traceparent"]
    assert traceparent == f"00-{TRACE_ID}-{spans['upstream'].context.span_id:016x}-01"


async def test_a_refusal_is_counted_by_the_error_table_and_holds_nothing() -> None:
    plane, exporter = _traced_plane()
    await _served(plane, "k1")
    with pytest.raises(QuotaExceeded):
        await _served(plane, "k1")
    labels = {"rpc": "Generate", "model": "m", "tenant": "one", "class": "standard"}
    assert _count(plane, "qosgate_requests_total", **labels, code="RESOURCE_EXHAUSTED") == 1
    assert _count(plane, "qosgate_rejections_total", reason="quota", tenant="one", **{"class": "standard"}) == 1
    assert plane.scheduler.snapshot().in_flight.get("m", 0) == 0
    refused = [s for s in exporter.get_finished_spans() if s.name == "qosgate Generate"][-1]
    assert refused.attributes["qosgate.code"] == "RESOURCE_EXHAUSTED"


async def test_an_error_before_admission_is_counted_too() -> None:
    plane = _plane()
    tenant = plane.directory.identify([("x-api-key", "k")])
    with pytest.raises(InvalidArgument):
        async with plane.open("Embed", tenant, "m"):
            raise InvalidArgument("inputs must not be empty")
    labels = {"rpc": "Embed", "model": "m", "tenant": "acme", "class": "", "code": "INVALID_ARGUMENT"}
    assert _count(plane, "qosgate_requests_total", **labels) == 1


async def _generation(plane: DataPlane, max_tokens: int, used: tuple[int, int], reason: str | None) -> None:
    """One LLM call of tenant meter: 100 prompt tokens, `max_tokens` reserved, `used`
    (prompt, completion) settled with `reason`."""
    tenant = plane.directory.identify([("x-api-key", "k2")])
    async with plane.open("GenerateStream", tenant, "m") as scope:
        cost = scope.llm_cost(100, max_tokens)
        assert (cost.tokens, cost.fair_share) == (100 + max_tokens, 100 + 2.0 * max_tokens)
        await scope.admit(cost, priority_class=None, deadline=None)
        scope.settle_tokens("r", *used, reason)


async def test_an_llm_call_is_settled_at_what_it_used_and_recorded_once() -> None:
    plane = _plane()  # tokens_per_minute 1000, and the clock never moves: nothing refills
    await _generation(plane, 400, (100, 20), "stop")  # 500 reserved, 120 used
    # Had the first call kept its 500, 800 more would not fit in the minute's 1000.
    await _generation(plane, 700, (100, 700), "length")
    with pytest.raises(QuotaExceeded):
        await _generation(plane, 1, (0, 0), None)  # 920 + 101 > 1000
    summary = await plane.usage.day_summary("meter", "2026-01-01")
    assert (summary.requests, summary.prompt_tokens, summary.completion_tokens) == (2, 200, 720)
    assert _count(plane, "qosgate_tokens_total", model="m", tenant="meter", kind="completion") == 720


async def test_an_llm_call_the_engine_never_answered_costs_and_records_nothing() -> None:
    plane = _plane()
    await _generation(plane, 900, (100, 0), None)  # reserved 1000, the whole minute
    await _generation(plane, 900, (100, 900), "length")  # fits: the first gave all of it back
    summary = await plane.usage.day_summary("meter", "2026-01-01")
    assert (summary.requests, summary.prompt_tokens, summary.completion_tokens) == (1, 100, 900)


async def test_a_cancelled_call_frees_its_slot_for_the_next() -> None:
    plane = _plane()
    tenant = plane.directory.identify([("x-api-key", "k")])
    holding = asyncio.Event()

    async def hold() -> None:
        async with plane.open("GenerateStream", tenant, "m") as scope:
            await scope.admit(CallCost(), priority_class=None, deadline=None)
            holding.set()
            await asyncio.Event().wait()

    task = asyncio.create_task(hold())
    await asyncio.wait_for(holding.wait(), 5)
    waiting = asyncio.create_task(_served(plane))
    await asyncio.sleep(0)
    assert not waiting.done()  # the window of 1 is taken
    task.cancel()
    await asyncio.wait_for(waiting, 5)
    labels = {"rpc": "GenerateStream", "model": "m", "tenant": "acme", "class": "standard", "code": "CANCELLED"}
    assert _count(plane, "qosgate_requests_total", **labels) == 1


async def test_free_slot_lets_the_next_call_dispatch_before_this_one_closes() -> None:
    plane = _plane()
    tenant = plane.directory.identify([("x-api-key", "k")])
    scope = plane.open("ModelStreamInfer", tenant, "m")
    await scope.admit(CallCost(), priority_class=None, deadline=None)
    scope.free_slot()
    scope.free_slot()  # idempotent
    await asyncio.wait_for(_served(plane), 5)
    await scope.close_with_code("UPSTREAM_ERROR")
    await scope.close(None)  # once only
    labels = {"rpc": "ModelStreamInfer", "model": "m", "tenant": "acme", "class": "standard"}
    assert _count(plane, "qosgate_requests_total", **labels, code="UPSTREAM_ERROR") == 1
    assert _count(plane, "qosgate_requests_total", **labels, code="OK") == 0


async def test_with_tracing_off_the_callers_traceparent_still_reaches_triton() -> None:
    plane = _plane()
    plane.tracing = Tracing()
    sent = await _served(plane, headers={"traceparent": TRACEPARENT})
    assert ("traceparent", TRACEPARENT) in sent
    assert await _served(plane) == []


def test_tracing_is_off_unless_an_otlp_endpoint_is_configured() -> None:
    off = Tracing.from_config(TracingConfig())
    assert not off.call_span("Generate", "acme", "m", None).is_recording()
    config = parse_config({"tracing": {"otlp_endpoint": "127.0.0.1:4317", "sample_ratio": 1.0}}, source="<test>")
    on = Tracing.from_config(config.tracing)
    try:
        # Not ended: nothing is queued for export to a collector that is not there.
        assert on.call_span("Generate", "acme", "m", None).is_recording()
    finally:
        on.shutdown()
